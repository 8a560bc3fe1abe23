"""status.queue of an InferenceService queued by Kueue (the decisions that fill it: admission.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ....core.model import ApiModel


class ServiceQueueStatus(ApiModel):
    """Admission by Kueue, for a service labelled kueue.x-k8s.io/queue-name."""

    name: str | None = Field(None, description="The LocalQueue (the service's kueue.x-k8s.io/queue-name label).")
    workload: str | None = Field(None, description="The Workload of the service's minimum replicas.")
    state: Literal["Queued", "Admitted", "Evicting"] | None = Field(
        None, description="Of the minimum replicas: Queued (nothing runs), Admitted, Evicting (stopping)."
    )
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted the service.")
    flavor: str | None = Field(None, description="The ResourceFlavor(s) admitted (comma-separated).")
    requested_replicas: int = Field(0, description="Replicas asked for (the autoscaler's, within min/max).")
    admitted_replicas: int = Field(0, description="Replicas Kueue admitted: the minimum plus admitted scale steps.")
    queued_steps: int = Field(0, description="Scale steps (one replica each) waiting for quota.")
    position: int | None = Field(
        None, description="While queued: its place in the ClusterQueue, 1 = next (Kueue's visibility API, if served)."
    )
    message: str | None = Field(None, description="Why replicas wait, as Kueue says it.")
    evictions: int = Field(0, description="Evictions by Kueue so far (of the minimum or of a scale step).")
