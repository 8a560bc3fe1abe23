"""What a kind provides to be queued by Kueue, and the reconcile of its Workload that every kind shares (pure).

Kueue's own integrations each implement one interface, jobframework.GenericJob (its object, pod sets, whether it
is suspended or still has pods running, run with the admitted pod sets, stop, finished), and one generic reconciler
drives them all. Loom's kinds are Kueue external frameworks that play the same part, split the way Loom splits
every controller: what the pure decision needs and what the edge needs are two small interfaces, so a decision
never holds the object it would write.

- `QueuedJob`, in the kind's pure decision: the pod set its Workload asks for (a name and how many pods), how many
  of its pods have not terminated (Kueue's IsActive), and the two things admission makes it do: run as many pods
  as were admitted (RunWithPodSetsInfo; the admitted flavors' node labels and tolerations are applied where the
  pods render, workload.place with QueueObservation.admitted_flavors) and stop its pods (Suspend; `force` once
  the bound for an evicted job's final checkpoint passed); and the words its status gives an eviction.
- `WorkloadOwner`, at the edge (io.py): the object, its Workload in a LocalQueue (its pod sets with their pod
  templates: workload.workload), and its pods' PriorityClass (Kueue's JobWithPriorityClass).
- `reconcile` is the generic part: the job's Workload as observed -> a `Gate` (Queued, Admitted, Evicting, and
  the Workload writes that follow: create it, release its quota once an evicted job stopped), applied to the job
  through its hooks. Marking a finished job's Workload Finished needs no hook: `finish_due`.

One Workload per job with one pod set: an object that needs several (an InferenceService's scale steps) reconciles
each of its Workloads with `admission` and keeps what joins them in its own queue package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol

from ..kit import Manifest
from .workload import Eviction, FlavorView, Position, Priority, WorkloadView

State = Literal["Queued", "Admitted", "Evicting"]


class Admittable(Protocol):
    """What `admission` reads of a job: its pod set, what it asks for, what still runs, how it words an eviction."""

    @property
    def pod_set(self) -> str:
        """The name of its Workload's pod set."""
        ...

    def requested(self) -> int:
        """Pods it asks for: the pod set's count."""
        ...

    def active(self) -> int:
        """Its pods that have not terminated (possibly being deleted)."""
        ...

    def describe_eviction(self, eviction: Eviction, active: int, *, force: bool) -> str:
        """An eviction in the words of the job's status: while `active` pods stop (`force`: past the bound), and
        once none is left (`active` 0: its quota is released and it is queued again)."""
        ...


class QueuedJob(Admittable, Protocol):
    """A kind's object in its pure decision, as `reconcile` drives it: admission's consequences applied to it."""

    def run(self, admitted: int) -> None:
        """Admitted: run this many pods (at most `requested`, fewer when Kueue admitted it partially)."""
        ...

    def stop(self, *, force: bool) -> None:
        """Stop every pod: not admitted (any more), or evicted. `force`: the bound for a graceful stop passed."""
        ...


class WorkloadOwner(Protocol):
    """A kind's object at the edge (io.py), as its Workload is made."""

    @property
    def body(self) -> Manifest:
        """The object as read: its metadata names, owns and labels the Workload."""
        ...

    def workload(self, queue: str, priority: Priority | None) -> Manifest:
        """Its Workload in LocalQueue `queue` (workload.workload with its pod sets)."""
        ...

    def priority_class(self) -> str | None:
        """Its pods' PriorityClass: the Workload's priority when no WorkloadPriorityClass label names one."""
        ...


@dataclass(frozen=True)
class QueueObservation:
    """A queued job's LocalQueue, its Workload (None: not created yet) and the ResourceFlavors it may run on."""

    name: str
    workload: WorkloadView | None
    flavors: dict[str, FlavorView] = field(default_factory=dict)
    position: Position | None = None  # while pending, when Kueue's visibility API reports it

    def admitted_flavors(self, pod_set: str) -> list[FlavorView]:
        """The flavors `pod_set` was admitted on (those the controller could read)."""
        if self.workload is None or (assignment := self.workload.assignment(pod_set)) is None:
            return []
        names = sorted(set(assignment.flavors.values()))
        return [self.flavors[n] for n in names if n in self.flavors]


@dataclass(frozen=True)
class Gate:
    """What Kueue's admission allows a job now, and the Workload writes that follow."""

    state: State
    admitted: int = 0  # pods that may run (Admitted)
    create_workload: bool = False
    stop: bool = False  # stop every pod: the job lost (or is losing) its admission
    force: bool = False  # the bound for a graceful stop passed: delete what is left without a grace period
    release: bool = False  # evicted and no pod runs any more: release the quota, requeue
    reason: str = "Queued"
    message: str = ""


def admission(
    queue: QueueObservation, job: Admittable, now: datetime | None = None, bound_s: float = math.inf
) -> Gate:
    """One Workload's admission as Kueue left it -> what its job may do. An evicted job stops its pods (gracefully
    until `bound_s` after the eviction; without a bound, as for serving replicas that hold nothing to save, the
    clock never matters) and its quota is released once none is left; a job never admitted, or no longer, runs
    nothing; an admitted one runs what was admitted of its pod set, at least one pod."""
    wl = queue.workload
    if wl is None:
        return Gate("Queued", create_workload=True, stop=True, message=f"waiting for Kueue in LocalQueue {queue.name}")
    active = job.active()
    if wl.eviction is not None and (wl.quota_reserved or active):
        eviction = wl.eviction
        if active:
            since = eviction.since or now
            force = now is not None and since is not None and (now - since).total_seconds() >= bound_s
            message = job.describe_eviction(eviction, active, force=force)
            return Gate("Evicting", stop=True, force=force, reason="Evicted", message=message)
        return Gate("Queued", release=True, reason="Requeued", message=job.describe_eviction(eviction, 0, force=False))
    if not wl.admitted:
        why = wl.waiting or f"waiting for Kueue in LocalQueue {queue.name}"
        # Admission gone without an eviction notice (deleted and recreated, say): no pod may keep running.
        return Gate("Queued", stop=bool(active), message=why)
    requested = job.requested()
    assignment = wl.assignment(job.pod_set)
    count = assignment.count if assignment is not None and assignment.count is not None else requested
    return Gate("Admitted", admitted=max(1, min(count, requested)), reason="Admitted")


def reconcile(queue: QueueObservation, job: QueuedJob, now: datetime, bound_s: float) -> Gate:
    """The job's Workload -> its Gate, applied to the job: stopped when it must stop, run when admitted."""
    gate = admission(queue, job, now, bound_s)
    if gate.stop:
        job.stop(force=gate.force)
    if gate.state == "Admitted":
        job.run(gate.admitted)
    return gate


def finish_due(queue: QueueObservation) -> bool:
    """A finished job's Workload is not marked Finished yet (that gives its quota back to the queue)."""
    return queue.workload is not None and not queue.workload.finished
