"""What the TrainingJob state machine decides from (Observation, Policy) and what it decides (Decision), and the part
of the machine its features drive (Machine, pure).

The machine is state.py. A feature package's transitions (queue/state.py: Kueue's admission and eviction;
data/state.py: waiting for the training set) are functions of a Machine: they read the observation and the new
status, and add to the decision through these hooks. So state.py imports the features and none imports state.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol

from ...core.kit import Event
from ...core.queue.job import QueueObservation
from .api import TrainingJobSpec, TrainingJobStatus
from .data.retrieval import DataObservation
from .observe import NodeView, ProgressReport, WorkerView


@dataclass(frozen=True)
class Policy:
    """Operator-wide knobs (not per job)."""

    node_lost_grace_seconds: float = 60.0
    # How long Restarting waits for a trainer that served progress before to report it resumed.
    resume_timeout_seconds: float = 600.0
    # How long an evicted job's workers get for their final checkpoint before they are force-deleted: the pods'
    # own grace period (render.TERMINATION_GRACE_SECONDS) and a margin for the node to report them gone.
    eviction_timeout_seconds: float = 150.0


@dataclass(frozen=True)
class Observation:
    generation: int | None
    spec: TrainingJobSpec
    status: TrainingJobStatus
    pods: tuple[WorkerView, ...]
    now: datetime
    nodes: dict[str, NodeView] = field(default_factory=dict)
    progress: ProgressReport | None = None
    tracking_ready: bool = True  # the MLflow run exists (or no tracking is configured)
    tracking_error: str | None = None  # why the run could not be created yet
    spec_error: str | None = None  # the spec cannot be rendered (reported, never retried)
    # An endpoint neither the spec nor the operator's defaults name (defaults.py): Pending, Ready=False
    # EndpointNotConfigured, until the object or the operator's configuration gives one.
    endpoint_problem: str | None = None
    training_data: DataObservation | None = None  # spec.trainingData not built yet: where it stands
    # finetune.baseModel.fromTrainingJob: that job has not succeeded yet (reason, message): Pending until it has.
    base_wait: tuple[str, str] | None = None
    queue: QueueObservation | None = None  # labelled kueue.x-k8s.io/queue-name: its Workload as Kueue left it


@dataclass(frozen=True)
class Delete:
    name: str
    uid: str
    force: bool = False  # grace period 0: only for pods on a node that stopped answering


@dataclass
class Decision:
    status: TrainingJobStatus
    create: list[int] = field(default_factory=list)  # worker indices to create in status.attempt
    delete: list[Delete] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_children: bool = False  # ttlSecondsAfterFinished: pods, Service, ConfigMap, PodGroup
    create_workload: bool = False  # queued by Kueue and no Workload yet
    release_workload: bool = False  # evicted and every worker gone: release the quota, requeue
    finish_workload: bool = False  # finished: mark the Workload Finished (frees the quota)


class Machine(Protocol):
    """One reconcile step of one job while it runs (state.py's machine), as a feature's transitions use it."""

    obs: Observation
    policy: Policy
    spec: TrainingJobSpec
    st: TrainingJobStatus  # the new status, changed in place
    decision: Decision
    desired: int  # workers the job runs now (Kueue may admit fewer than spec.workers.replicas)
    reason_detail: tuple[str, str] | None  # (reason, message) for Ready while not running
    data_detail: tuple[str, str] | None  # (reason, message) of TrainingDataReady=False

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None: ...

    def delete(self, pod: WorkerView, *, force: bool = False) -> None: ...

    def node_lost(self, pod: WorkerView) -> bool:
        """The pod's node has not been Ready for longer than the grace period."""
        ...

    def finish(self, phase: str, reason: str, message: str) -> Decision:
        """The job ends: Succeeded or Failed, its workers stopped."""
        ...

    def conclude(self, current: dict[int, WorkerView] | None = None) -> Decision:
        """Phase, worker counts and conditions from what the step set: the step's decision."""
        ...
