"""A TrainingJob queued by Kueue (pure): its Workload, as core/queue's WorkloadOwner.

A job labelled `kueue.x-k8s.io/queue-name` runs no worker until Kueue admits its Workload (one pod set
`workers`: a pod per worker, each asking for the worker's CPU, memory and GPUs; an elastic job's minReplicas is
the pod set's minCount, so Kueue may admit it partially, with fewer workers). Admitted, the workers start with the
admitted flavor's node labels and tolerations; the admitted count is how many start (state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ....core.kit import Manifest
from ....core.queue import workload as kueue
from .. import render
from ..api import TrainingJobSpec
from ..config import worker_range

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
class TrainingWorkload:
    """The job as core/queue's WorkloadOwner: its Workload's pod set is rendered from worker 0 of attempt 0."""

    kind: ClassVar[str] = "TrainingJob"
    body: Manifest
    spec: TrainingJobSpec
    image: str

    def workload(self, queue: str, priority: kueue.Priority | None) -> Manifest:
        worker = render.worker_pod(self.body, self.spec, 0, attempt=0, image=self.image, mlflow_run_id=None)
        return workload(self.body, self.spec, worker, queue, priority)

    def priority_class(self) -> str | None:
        return self.spec.scheduling.priority_class_name
