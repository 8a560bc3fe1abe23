"""The edge of the picker's leader election (election.py decides): the Lease read and written every `retry_s`
with the standard `kubernetes` client in a thread, as the pod watch (kube.py) does. The operator creates the Lease
(traffic/picker.py), so the pod's Role needs only get and update on that one name.

On the way out (`stop`), a leader frees the Lease at once, so a standby takes over at its next look instead of
after the Lease's duration."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

import kubernetes
from kubernetes.client.exceptions import ApiException

from .config import LeaderElectionConfig
from .election import Election, Write, lease_object, lease_state

log = logging.getLogger("loom.workloads.picker")


def micro_time(moment: datetime) -> str:
    """Kubernetes' MicroTime (RFC 3339, microseconds, UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(self, namespace: str, config: LeaderElectionConfig, identity: str,
                 api: kubernetes.client.ApiClient) -> None:
        self.namespace, self.name = namespace, config.lease_name
        self.election = Election(identity, config.duration_seconds, config.renew_deadline_seconds)
        self.retry_s = config.retry_seconds
        self.api = api
        self.coordination = kubernetes.client.CoordinationV1Api(api)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._was_leading = False

    def leading(self) -> bool:
        return self.election.leading()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop electing and free the Lease if this pod holds it (blocking: call it from a thread)."""
        self._stop.set()
        self._thread.join()
        try:
            current = self._read()
            write = self.election.release(lease_state(current))
            if write is not None and self._write(current, write):
                log.info("leader election: Lease %s released", self.name)
        except Exception as exc:  # leaving anyway: the standby takes over after the Lease's duration
            log.warning("leader election: could not release Lease %s: %s", self.name, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except ApiException as exc:
                if exc.status == 404:
                    log.warning("leader election: no Lease %s/%s yet (the operator creates it)", self.namespace,
                                self.name)
                else:
                    log.warning("leader election: reading Lease %s failed: %s", self.name, exc.reason)
            except Exception as exc:  # the API unreachable: try again; a leader stops at its renew deadline
                log.warning("leader election: %s", exc)
            self._stop.wait(self.retry_s)

    def step(self) -> None:
        """One look at the Lease: read, decide, write."""
        current = self._read()
        write = self.election.plan(lease_state(current))
        if write is not None:
            self.election.written(self._write(current, write))
        leading = self.election.leading()
        if leading != self._was_leading:
            log.info("leader election: %s %s", self.election.identity,
                     "leads: serving" if leading else "stands by: not serving")
            self._was_leading = leading

    def _read(self) -> dict[str, object]:
        lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        body: dict[str, object] = self.api.sanitize_for_serialization(lease)
        return body

    def _write(self, current: dict[str, object], write: Write) -> bool:
        body = lease_object(current, write, micro_time(datetime.now(UTC)))
        try:
            self.coordination.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # written meanwhile (another pod took or renewed it): read again next time
                return False
            raise
        return True
