"""Which of a service's picker pods serves: leader election over one coordination.k8s.io Lease (pure: no I/O; the
edge that reads and writes the Lease is lease.py).

The rules are client-go's leader election, so the Lease reads the same to anyone who knows that:
- the holder renews every `retry_s`; it leads until `renew_deadline_s` after the start of its last successful
  write, and so stops leading on its own when it cannot write (the API server unreachable, a conflict), before
  anyone else may take over;
- another pod takes the Lease when it is free (no holder: never held, or released by a holder that stopped) or
  when the record has not changed for the Lease's duration, measured on the taker's own clock from when it first
  saw that record (never from the record's timestamps: the pods' clocks need not agree);
- every write carries the resourceVersion read, so of two pods taking at once the API server lets one through.

`renew_deadline_s` < `duration_s` is what makes two leaders impossible short of a clock running that much fast: a
leader that has not renewed stops `duration_s - renew_deadline_s` before a standby may take over.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LeaseState:
    """What the election reads of the Lease."""

    holder: str  # "" when nobody holds it (never held, or released)
    renew_time: str | None
    duration_s: int | None
    transitions: int
    version: str  # metadata.resourceVersion: the precondition of the next write


@dataclass(frozen=True)
class Write:
    """The Lease as this pod is to write it (lease.py turns it into the object)."""

    holder: str
    duration_s: int
    acquire: bool  # a new term: acquireTime now, leaseTransitions + 1
    transitions: int
    version: str


def lease_state(lease: Mapping[str, Any]) -> LeaseState:
    """A coordination.k8s.io/v1 Lease, as the API server returns it (JSON field names)."""
    spec = lease.get("spec") or {}
    return LeaseState(
        holder=spec.get("holderIdentity") or "",
        renew_time=spec.get("renewTime"),
        duration_s=spec.get("leaseDurationSeconds"),
        transitions=spec.get("leaseTransitions") or 0,
        version=(lease.get("metadata") or {}).get("resourceVersion", ""),
    )


class Election:
    def __init__(self, identity: str, duration_s: float = 15.0, renew_deadline_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < renew_deadline_s < duration_s:
            raise ValueError("the renew deadline must be shorter than the lease's duration")
        self.identity = identity
        self.duration_s = duration_s
        self.renew_deadline_s = renew_deadline_s
        self.clock = clock
        self._leading_until = -math.inf
        self._seen: tuple[str, str | None, int] | None = None  # the other holder's record last seen
        self._seen_at = 0.0
        self._attempt_at: float | None = None

    def leading(self) -> bool:
        return self.clock() < self._leading_until

    def plan(self, lease: LeaseState) -> Write | None:
        """What to write after reading `lease`: a renewal, a take-over, or nothing (another pod holds it)."""
        now = self.clock()
        take = False
        if lease.holder == self.identity:
            take = False  # renew (also after a lost write: nobody took it meanwhile, or the holder would differ)
        elif not lease.holder:
            take = True
        else:
            self._leading_until = -math.inf  # someone else holds it: whatever this pod thought, it does not lead
            record = (lease.holder, lease.renew_time, lease.transitions)
            if record != self._seen:
                self._seen, self._seen_at = record, now
            if now - self._seen_at < (lease.duration_s or self.duration_s):
                self._attempt_at = None
                return None
            take = True
        self._attempt_at = now
        return Write(self.identity, math.ceil(self.duration_s), take,
                     lease.transitions + 1 if take else lease.transitions, lease.version)

    def written(self, ok: bool) -> None:
        """The planned write's outcome: accepted, this pod leads until the renew deadline from its start."""
        if ok and self._attempt_at is not None:
            self._leading_until = self._attempt_at + self.renew_deadline_s
            self._seen = None
        self._attempt_at = None

    def release(self, lease: LeaseState) -> Write | None:
        """On the way out: the Lease freed at once (no holder, as client-go's ReleaseOnCancel) so a standby takes
        over at its next look instead of after the duration; None when this pod does not hold it."""
        self._leading_until = -math.inf
        if lease.holder != self.identity:
            return None
        return Write("", 1, False, lease.transitions, lease.version)


def lease_object(current: Mapping[str, Any], write: Write, now: str) -> dict[str, Any]:
    """The Lease to PUT: `current` (as read, its resourceVersion the precondition) with `write`'s spec; `now` is an
    RFC 3339 MicroTime (renewTime, and acquireTime of a new term)."""
    spec = dict(current.get("spec") or {})
    spec.update(holderIdentity=write.holder or None, leaseDurationSeconds=write.duration_s, renewTime=now,
                leaseTransitions=write.transitions)
    if write.acquire:
        spec["acquireTime"] = now
    metadata = {**(current.get("metadata") or {}), "resourceVersion": write.version}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
