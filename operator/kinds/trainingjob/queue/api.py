"""status.queue of a TrainingJob queued by Kueue (state.py writes it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ....core.model import ApiModel


class QueueEviction(ApiModel):
    """The last time Kueue evicted the job (preemption, a quota change, a waitForPodsReady timeout)."""

    reason: str = Field(description="Kueue's reason: Preempted, PodsReadyTimeout, ClusterQueueStopped, ...")
    message: str = ""
    time: str | None = Field(None, description="When Kueue evicted the workload.")
    stopped_time: str | None = Field(None, description="When the last worker stopped and the quota was released.")
    checkpointed: bool | None = Field(
        None,
        description="True: workers were seen exiting after their final checkpoint (exit 143); false: forced after the "
        "bound; unset: the workers were gone before the operator saw how they exited.",
    )
    checkpoint_step: int | None = Field(None, description="The step the job resumes from when readmitted.")


class QueueStatus(ApiModel):
    """Admission by Kueue, for a job labelled kueue.x-k8s.io/queue-name."""

    name: str | None = Field(None, description="The LocalQueue (the job's kueue.x-k8s.io/queue-name label).")
    workload: str | None = Field(None, description="The Kueue Workload Loom created for this job.")
    state: Literal["Queued", "Admitted", "Evicting", "Finished"] | None = None
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted the job.")
    flavor: str | None = Field(None, description="The ResourceFlavor(s) admitted (comma-separated).")
    admitted_workers: int | None = Field(None, description="Workers admitted (fewer than replicas: partial admission).")
    message: str | None = Field(None, description="Why the job waits, as Kueue says it.")
    position: int | None = Field(
        None, description="While queued: its place in the ClusterQueue, 1 = next (Kueue's visibility API, if served)."
    )
    evictions: int = Field(0, description="Evictions by Kueue so far (not counted as restarts or failures).")
    last_eviction: QueueEviction | None = None
