"""High availability on the local stack: the chart with two operator replicas (Kopf peering), exactly one of them
reconciling; the active pod force-deleted (grace 0); the standby takes over; its replacement stands by; then
the new active replica hangs (SIGSTOP) and the replacement takes over once the keep-alive expires; nothing is
created twice.

Children are counted from watch events (ADDED per name), not from the final list: a child deleted and created
again by a second replica would leave a correct-looking list behind. "Who reconciles" is read from each replica's
own metrics (`loom_leader`, `loom_reconcile_duration_seconds_count`), scraped on its pod address.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.helm_operator import InClusterOperator, operator_in_cluster, wait_default_service_account
from loom.e2e.tests.test_helm_install import job_phase, training_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

# Short, so the test is quick; the chart's default is 30 s. The takeover bound is this (a replica that hangs or
# dies without a word) plus one reconcile pass; a replica that exits (SIGTERM) hands over at once.
LIFETIME_S = 10
CHILD_KINDS = ("pods", "services", "configmaps")
JOBS = ("before", "during", "after", "stalled")


class ChildWatch:
    """Records every watch event of pods, Services and ConfigMaps in a namespace, from before anything exists."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.events: list[tuple[str, str, str, str]] = []  # (type, kind, name, uid)
        self._lock = threading.Lock()
        self._watches: list[watch.Watch] = []
        self._stopped = False
        self.failure: str | None = None
        self._threads = [
            threading.Thread(target=self._run, args=(cluster, namespace, kind), daemon=True) for kind in CHILD_KINDS
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, cluster: Cluster, namespace: str, kind: str) -> None:
        with cluster.api_client() as api:
            core = client.CoreV1Api(api)
            lister = {"pods": core.list_namespaced_pod, "services": core.list_namespaced_service}.get(
                kind, core.list_namespaced_config_map
            )
            w = watch.Watch()
            self._watches.append(w)
            try:
                for event in w.stream(lister, namespace, timeout_seconds=280):
                    meta = event["object"].metadata
                    with self._lock:
                        self.events.append((event["type"], kind, meta.name, meta.uid))
            except Exception as error:  # the connection closes when the test stops watching; else it is a failure
                if not self._stopped:
                    self.failure = f"watch of {kind} ended: {error!r}"

    def stop(self) -> None:
        self._stopped = True
        for w in self._watches:
            w.stop()

    def added(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter((kind, name) for kind_type, kind, name, _ in self.events if kind_type == "ADDED")

    def deleted(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(kind, name) for kind_type, kind, name, _ in self.events if kind_type == "DELETED"]


@pytest.fixture
def ha_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"ha{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_default_service_account(cluster, name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def operator_pods(cluster: Cluster, op: InClusterOperator) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "pods", "-n", op.namespace, "-l", f"app.kubernetes.io/instance={op.release}", "-o", "json"
    ).stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions", [])}
    return conditions.get("Ready") == "True"


def peers(cluster: Cluster, op: InClusterOperator) -> dict[str, dict[str, Any]]:
    """The live entries of the release's ClusterKopfPeering (identity = pod name)."""
    result = cluster.kubectl("get", "clusterkopfpeering", op.name, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    now = datetime.datetime.now(datetime.UTC)
    live = {}
    for identity, info in (json.loads(result.stdout).get("status") or {}).items():
        seen = datetime.datetime.fromisoformat(info["lastseen"])
        if seen + datetime.timedelta(seconds=int(info["lifetime"])) > now:
            live[identity] = info
    return live


def metrics(pod: dict[str, Any], port: int = 8081) -> dict[str, float]:
    """The replica's own /metrics on its pod address: {name{labels}: value} for the series this test reads."""
    url = f"http://{pod['status']['podIP']}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("loom_leader", "loom_reconcile_duration_seconds_count"):
                values[s.name + (f"{{{s.labels.get('kind')}}}" if s.labels else "")] = s.value
    return values


def leads(pod: dict[str, Any]) -> bool:
    """True once the replica's loom_leader gauge says it leads. Kopf resumes its handlers the moment the peering
    allows; the gauge follows on the leadership check's next round (seconds later), so it is waited for."""
    wait_until(lambda: metrics(pod)["loom_leader"] == 1, 30, f"loom_leader 1 on {pod['metadata']['name']}")
    return True


def reconciled(pod: dict[str, Any]) -> float:
    return metrics(pod).get("loom_reconcile_duration_seconds_count{TrainingJob}", 0.0)


def operator_pid(pod_name: str) -> int:
    """The operator process of a pod the node agent runs on this machine (local stack only)."""
    needle = f"LOOM_POD_NAME={pod_name}".encode()
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in environ and b"operator" in cmdline:
            return int(proc.name)
    raise AssertionError(f"no operator process of pod {pod_name} on this machine")


def apply_job(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(training_job(name)))


def test_the_standby_takes_over_when_the_active_replica_dies(
    cluster: Cluster, ha_namespace: str, tmp_path: Path
) -> None:
    ns = ha_namespace
    children = ChildWatch(cluster, ns)
    values = {"replicas": 2, "peering": {"lifetimeSeconds": LIFETIME_S}}
    with operator_in_cluster(cluster, [ns], values=values, workdir=tmp_path) as op:
        try:
            pods = wait_until(
                lambda: (found := operator_pods(cluster, op)) and len(found) == 2 and all(map(ready, found)) and found,
                timeout=120,
                what="both operator replicas Ready",
            )
            by_name = {p["metadata"]["name"]: p for p in pods}
            # Both replicas keep their entries alive; the older (higher priority) leads.

            def both_alive() -> dict[str, dict[str, Any]] | None:
                live = peers(cluster, op)
                return live if set(live) == set(by_name) else None

            live = wait_until(both_alive, 60, "both replicas' keep-alives")
            leader = max(live, key=lambda identity: int(live[identity]["priority"]))
            (standby,) = set(by_name) - {leader}

            apply_job(cluster, ns, "before")
            wait_until(lambda: job_phase(cluster, ns, "before") == "Running", 90, "job 'before' Running")
            # Exactly one replica reconciles: the standby has run no pass at all and says it stands by.
            assert reconciled(by_name[leader]) > 0 and leads(by_name[leader])
            assert reconciled(by_name[standby]) == 0 and metrics(by_name[standby])["loom_leader"] == 0
            # Kopf ran no handler there either (it starts paused and stays so while an older peer lives).
            assert "Handler '" not in cluster.kubectl("logs", standby, "-n", op.namespace).stdout

            # The active replica dies; a job is created while nobody may be reconciling.
            cluster.kubectl("delete", "pod", leader, "-n", op.namespace, "--force", "--grace-period=0")
            killed = time.monotonic()
            apply_job(cluster, ns, "during")
            wait_until(lambda: job_phase(cluster, ns, "during") == "Running", LIFETIME_S + 60, "takeover")
            takeover_s = time.monotonic() - killed
            print(f"\ntakeover: job created at the kill Running after {takeover_s:.1f}s (lifetime {LIFETIME_S}s)")
            assert reconciled(by_name[standby]) > 0 and leads(by_name[standby])

            # The Deployment's replacement pod comes up younger: it stands by and reconciles nothing.
            def replacement() -> dict[str, Any] | None:
                fresh = [p for p in operator_pods(cluster, op) if p["metadata"]["name"] not in by_name]
                return fresh[0] if fresh and ready(fresh[0]) else None

            new = wait_until(replacement, 120, "the replacement replica Ready")
            wait_until(lambda: new["metadata"]["name"] in peers(cluster, op), 30, "the replacement's keep-alive")
            apply_job(cluster, ns, "after")
            wait_until(lambda: job_phase(cluster, ns, "after") == "Running", 90, "job 'after' Running")
            assert reconciled(new) == 0 and metrics(new)["loom_leader"] == 0
            assert leader not in peers(cluster, op)

            # The worst case: the active replica hangs without a word (SIGSTOP: no exit, no keep-alive). The
            # standby takes over once its keep-alive expires: within the lifetime.
            hung = operator_pid(standby)
            os.kill(hung, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                apply_job(cluster, ns, "stalled")
                wait_until(lambda: job_phase(cluster, ns, "stalled") == "Running", LIFETIME_S + 60, "takeover")
                hang_takeover_s = time.monotonic() - stopped
                assert reconciled(new) > 0 and leads(new)
            finally:
                os.kill(hung, signal.SIGKILL)  # never resumed: older, it would lead again
            print(f"takeover after a hang (SIGSTOP): {hang_takeover_s:.1f}s (lifetime {LIFETIME_S}s)")
            deleted = children.deleted()  # before the clean-up below deletes everything
        except (AssertionError, TimeoutError) as error:
            logs = "\n".join(
                f"--- {p['metadata']['name']}\n" + cluster.kubectl("logs", p["metadata"]["name"], "-n", op.namespace,
                                                                  "--tail=40", check=False).stdout
                for p in operator_pods(cluster, op)
            )  # fmt: skip
            raise AssertionError(f"{error}\n{logs}") from None
        finally:
            children.stop()
            cluster.kubectl("delete", "loom", "--all", "-n", ns, "--timeout=60s", check=False)

    # Nothing was created twice (or deleted and created again) across the takeover.
    assert children.failure is None, children.failure
    added = children.added()
    expected = {
        ("pods", f"{job}-worker-{i}") for job in JOBS for i in (0, 1)
    } | {(kind, f"{job}-{suffix}") for job in JOBS for kind, suffix in
         (("services", "workers"), ("configmaps", "trainer"))}  # fmt: skip
    assert expected <= set(added), expected - set(added)
    twice = {key: count for key, count in added.items() if count > 1}
    assert not twice, twice
    assert not [key for key in deleted if key in expected], deleted
