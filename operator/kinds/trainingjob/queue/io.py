"""A queued TrainingJob's Workload reads and writes (thin: core/queue/io.py does them; state.py decided which)."""

from __future__ import annotations

from datetime import UTC, datetime

from ....core.kit import Manifest
from ....core.queue import io as queue_io
from ....core.queue.job import QueueObservation
from ..api import TrainingJobSpec
from ..decision import Decision
from .workload import TrainingWorkload


async def observe_queue(job: Manifest) -> QueueObservation | None:
    """For a job labelled kueue.x-k8s.io/queue-name: its Workload, the flavors it was admitted on, and while it
    waits its position in the queue (when Kueue's visibility API answers)."""
    return await queue_io.observe(TrainingWorkload.kind, job)


async def act_on_workload(
    job: Manifest, spec: TrainingJobSpec, image: str, decision: Decision, queue: QueueObservation
) -> None:
    """Create the Workload, release its quota after an eviction, or mark it Finished."""
    view, now = queue.workload, datetime.now(UTC)
    if decision.create_workload:
        await queue_io.create(TrainingWorkload(job, spec, image), queue.name, "the job")
        return
    if view is None:
        return
    namespace = job["metadata"]["namespace"]
    if decision.release_workload:
        await queue_io.release_quota(namespace, view, now)
    elif decision.finish_workload:
        phase = decision.status.phase
        await queue_io.mark_finished(namespace, view, phase == "Succeeded", f"TrainingJob {phase}", now)
