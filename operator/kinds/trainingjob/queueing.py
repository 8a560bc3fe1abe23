"""A TrainingJob queued by Kueue (pure): its Workload, and what admission allows the state machine to do.

A job labelled `kueue.x-k8s.io/queue-name` runs no worker until Kueue admits its Workload (one pod set
`workers`: a pod per worker, each asking for the worker's CPU, memory and GPUs; an elastic job's minReplicas is
the pod set's minCount, so Kueue may admit it partially, with fewer workers). Admitted, the workers start with the
admitted flavor's node labels and tolerations; the admitted count is how many start.

Evicted by Kueue (preempted by a higher priority, a quota change, a waitForPodsReady timeout), the job loses no
work: every worker gets a graceful delete, which is the trainer's signal to write a final checkpoint (SIGTERM ->
a blocking save, then exit 143; workloads/trainer/README.md); the job waits for that, at most
Policy.eviction_timeout_seconds after the eviction, then force-deletes what is left; once no worker runs, the
quota is released and the Workload requeued. Readmitted, a new gang attempt resumes from that checkpoint. An
eviction is not a failure: neither status.restarts nor status.failures counts it (status.queue.evictions does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from loom.workloads.trainer.config import EXIT_INTERRUPTED

from ...core import kueue
from ...core.kit import Manifest
from .api import TrainingJobSpec
from .config import worker_range
from .observe import WorkerView

POD_SET = "workers"


def pod_set(worker: Manifest, spec: TrainingJobSpec) -> kueue.PodSet:
    """The workers as one pod set, from a rendered worker pod (so what Kueue accounts is what the pods ask for)."""
    low, _ = worker_range(spec)
    replicas = spec.workers.replicas
    return kueue.PodSet(
        name=POD_SET, count=replicas, template=kueue.pod_template(worker), min_count=low if low < replicas else None
    )


def workload(
    job: Manifest, spec: TrainingJobSpec, worker: Manifest, queue: str, priority: kueue.Priority | None = None
) -> Manifest:
    return kueue.workload(job, queue, [pod_set(worker, spec)], priority)


@dataclass(frozen=True)
class QueueObservation:
    """The job's LocalQueue, its Workload (None: not created yet) and the ResourceFlavors it may be admitted on."""

    name: str
    workload: kueue.WorkloadView | None
    flavors: dict[str, kueue.FlavorView] = field(default_factory=dict)
    position: kueue.Position | None = None  # while pending, when Kueue's visibility API reports it

    def admitted_flavors(self) -> list[kueue.FlavorView]:
        """The flavors of the workers' admission (those the controller could read)."""
        if self.workload is None or (assignment := self.workload.assignment(POD_SET)) is None:
            return []
        names = sorted(set(assignment.flavors.values()))
        return [self.flavors[n] for n in names if n in self.flavors]


@dataclass(frozen=True)
class Gate:
    """What Kueue's admission allows now."""

    state: str  # Queued | Admitted | Evicting
    workers: int = 0  # workers that may run (Admitted)
    create_workload: bool = False
    stop: bool = False  # stop every worker: the job lost (or is losing) its admission
    force: bool = False  # the checkpoint bound passed: delete what is left without a grace period
    release: bool = False  # no worker runs any more: release the quota, requeue
    reason: str = "Queued"
    message: str = ""


def gate(
    obs: QueueObservation, spec: TrainingJobSpec, pods: tuple[WorkerView, ...], now: datetime, bound_s: float
) -> Gate:
    wl = obs.workload
    if wl is None:
        return Gate("Queued", create_workload=True, stop=True, message=f"waiting for Kueue in LocalQueue {obs.name}")
    running = [p for p in pods if live(p)]
    if wl.eviction is not None and (wl.quota_reserved or running):
        eviction = wl.eviction
        if running:
            since = eviction.since or now
            force = (now - since).total_seconds() >= bound_s
            what = "forcing the rest" if force else "waiting for their final checkpoint"
            message = f"{eviction.reason}: {len(running)} worker(s) stopping, {what}"
            return Gate("Evicting", stop=True, force=force, reason="Evicted", message=message)
        return Gate("Queued", release=True, reason="Requeued", message=f"{eviction.reason}: {eviction.message}".strip())
    if not wl.admitted:
        why = wl.waiting or f"waiting for Kueue in LocalQueue {obs.name}"
        # Admission gone without an eviction notice (deleted and recreated, say): no worker may keep running.
        return Gate("Queued", stop=bool(running), message=why)
    assignment = wl.assignment(POD_SET)
    count = assignment.count if assignment is not None and assignment.count is not None else spec.workers.replicas
    return Gate("Admitted", workers=max(1, min(count, spec.workers.replicas)), reason="Admitted")


def checkpointed(pods: tuple[WorkerView, ...]) -> bool:
    """Every worker that stopped did so after its final checkpoint (the trainer exits 143 only after it)."""
    stopped = [p for p in pods if p.phase in ("Succeeded", "Failed")]
    return bool(stopped) and all(p.exit_code == EXIT_INTERRUPTED or p.phase == "Succeeded" for p in stopped)


def live(pod: WorkerView) -> bool:
    """Not terminated yet (possibly already being deleted)."""
    return pod.phase in ("Pending", "Running", "Unknown")
