"""What the TrainingJob state machine sees: worker pods, nodes and the trainer's progress, parsed from raw
API objects into small immutable views (pure).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from loom.workloads.trainer.config import EXIT_INTERRUPTED

from ...core.kit import Manifest, parse_time
from ...core.pod_problems import UNSCHEDULABLE, PodProblem, find_problem
from .render import ATTEMPT_LABEL, INDEX_LABEL

# The phase the trainer's progress document (workloads/trainer/tracking.py) shows before its first step.
TRAINER_STARTING = "Starting"

# Pod status reasons / conditions that mean the platform took the pod away: not the trainer's fault.
DISRUPTION_REASONS = frozenset(
    {"Evicted", "Preempted", "Preempting", "NodeLost", "NodeShutdown", "Terminated", "Shutdown"}
)


@dataclass(frozen=True)
class CheckpointReport:
    uri: str
    step: int | None = None
    time: str | None = None


@dataclass(frozen=True)
class UploadRetryReport:
    """The trainer is retrying a checkpoint upload (progress `checkpointRetry`, until the next commit)."""

    failed_attempts: int
    last_error: str | None = None  # an exception class or S3 error code, never a message
    step: int | None = None
    since: str | None = None


@dataclass(frozen=True)
class WorkerView:
    """One worker pod as the state machine needs it."""

    name: str
    uid: str
    index: int
    attempt: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    node_name: str | None = None
    created: datetime | None = None
    deleting: bool = False
    exit_code: int | None = None
    reason: str | None = None
    message: str = ""
    unschedulable: str | None = None  # the scheduler's message while it cannot place the pod
    disrupted: bool = False  # evicted, preempted, node shut down: not counted as a failure
    final_checkpoint: CheckpointReport | None = None  # named by the trainer's termination message on success
    final_loss: float | None = None  # the last step's loss, from the same message
    final_step: int | None = None  # the last step, from the same message
    problem: PodProblem | None = None  # why it cannot start (a missing Secret, ...); Unschedulable is the field above

    @property
    def live(self) -> bool:
        """Not terminated yet (possibly already being deleted)."""
        return self.phase in ("Pending", "Running", "Unknown")

    @property
    def active(self) -> bool:
        return self.live and not self.deleting


@dataclass(frozen=True)
class NodeView:
    name: str
    ready: bool
    since: datetime | None  # lastTransitionTime of the Ready condition


@dataclass(frozen=True)
class ProgressReport:
    """The trainer's progress document (served by rank 0; see progress.py)."""

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    samples_per_second: float | None = None
    eta: str | None = None
    latest_checkpoint: CheckpointReport | None = None
    # The trainer's own phase: "Starting" until its first step after (re)start (rendezvous, restoring the
    # checkpoint), then "Running". None when unknown (Prometheus gauges carry no phase).
    phase: str | None = None
    # Failed S3 attempts since the newest commit; None while checkpoints land (or the report cannot tell).
    checkpoint_retry: UploadRetryReport | None = None

    @property
    def starting(self) -> bool | None:
        """The trainer has not run a step since it (re)started; None when the report cannot tell."""
        return None if self.phase is None else self.phase == TRAINER_STARTING


def _condition(obj: Manifest, kind: str) -> Manifest | None:
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _termination_document(pod: Manifest) -> Manifest:
    """The JSON termination message of the pod's container ({} when there is none or it is not JSON)."""
    for status in pod.get("status", {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated") or {}
        try:
            doc = json.loads(str(terminated.get("message") or ""))
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return {}


def _final_loss(doc: Manifest) -> float | None:
    """The last step's loss a successful trainer names in its termination message (`doc`)."""
    final = doc.get("final")
    loss = _number(final.get("loss"), float) if isinstance(final, dict) else None
    return loss if loss is not None and math.isfinite(loss) else None  # status is JSON: no NaN or infinity


def _final_step(doc: Manifest) -> int | None:
    """The last step a successful trainer names in its termination message (`doc`)."""
    final = doc.get("final")
    step = _number(final.get("step"), int) if isinstance(final, dict) else None  # read as the progress document's
    return step if step is not None and step >= 0 else None


def _final_checkpoint(doc: Manifest) -> CheckpointReport | None:
    """The checkpoint a successful trainer names in its JSON termination message (`doc`)."""
    checkpoint = doc.get("checkpoint")
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("uri"), str):
        return None
    step, time = checkpoint.get("step"), checkpoint.get("time")
    return CheckpointReport(
        uri=checkpoint["uri"], step=step if isinstance(step, int) else None,
        time=time if isinstance(time, str) else None,
    )


def _termination(pod: Manifest) -> tuple[int | None, str | None, str]:
    """(exit code, reason, message) of the trainer container once it terminated.

    The trainer may write a JSON termination message {"exitCode": N, ...}: torchrun exits 1 whatever its
    children returned, so that message is how a permanent error survives the agent.
    """
    for status in pod.get("status", {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if not terminated:
            continue
        code = terminated.get("exitCode")
        message = str(terminated.get("message") or "")
        try:
            doc = json.loads(message)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("exitCode"), int):
            code = doc["exitCode"]
            message = str(doc.get("message", message))
        return code, terminated.get("reason"), message.strip()[-512:]
    return None, None, ""


def observe_pod(pod: Manifest) -> WorkerView | None:
    """The worker view of a pod, or None for a pod that lacks Loom's worker labels."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    try:
        index, attempt = int(labels[INDEX_LABEL]), int(labels[ATTEMPT_LABEL])
    except (KeyError, ValueError):
        return None
    status = pod.get("status", {})
    phase = status.get("phase") or "Pending"
    exit_code, term_reason, message = _termination(pod)
    reason = status.get("reason") or term_reason
    scheduled = _condition(pod, "PodScheduled")
    unschedulable = None
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "no node fits the worker"
    ready = _condition(pod, "Ready")
    disruption = _condition(pod, "DisruptionTarget")
    disrupted = bool(disruption and disruption.get("status") == "True") or reason in DISRUPTION_REASONS
    final = _termination_document(pod) if phase == "Succeeded" else {}  # a failed worker's message names nothing
    return WorkerView(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        index=index,
        attempt=attempt,
        phase=phase,
        ready=phase == "Running" and bool(ready and ready.get("status") == "True"),
        node_name=pod.get("spec", {}).get("nodeName"),
        created=parse_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        exit_code=exit_code,
        reason=reason,
        message=message or str(status.get("message") or ""),
        unschedulable=unschedulable,
        disrupted=disrupted or (phase == "Failed" and exit_code == EXIT_INTERRUPTED),
        final_checkpoint=_final_checkpoint(final),
        final_loss=_final_loss(final),
        final_step=_final_step(final),
        problem=find_problem([pod], ignore={UNSCHEDULABLE}),
    )


def observe_node(node: Manifest) -> NodeView:
    ready = _condition(node, "Ready")
    return NodeView(
        name=node["metadata"]["name"],
        ready=bool(ready and ready.get("status") == "True"),
        since=parse_time(ready.get("lastTransitionTime")) if ready else None,
    )


def _number(value: Any, kind: type[int] | type[float]) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return kind(value)


def parse_progress(doc: Any) -> ProgressReport | None:
    """The trainer's progress JSON (camelCase) -> a report; anything malformed is ignored, never fatal."""
    if not isinstance(doc, dict):
        return None
    latest = doc.get("latestCheckpoint")
    checkpoint = None
    if isinstance(latest, dict) and isinstance(latest.get("uri"), str):
        checkpoint = CheckpointReport(
            uri=latest["uri"],
            step=_number(latest.get("step"), int),
            time=latest.get("time") if isinstance(latest.get("time"), str) else None,
        )
    eta = doc.get("eta")
    if isinstance(eta, int | float) and not isinstance(eta, bool):
        eta = format_duration(float(eta))
    phase = doc.get("phase")
    return ProgressReport(
        checkpoint_retry=_upload_retry(doc.get("checkpointRetry")),
        step=_number(doc.get("step"), int),
        total_steps=_number(doc.get("totalSteps"), int),
        loss=_number(doc.get("loss"), float),
        samples_per_second=_number(doc.get("samplesPerSecond"), float),
        eta=eta if isinstance(eta, str) else None,
        latest_checkpoint=checkpoint,
        phase=phase if isinstance(phase, str) else None,
    )


def _upload_retry(doc: Any) -> UploadRetryReport | None:
    if not isinstance(doc, dict):
        return None
    failed = _number(doc.get("failedAttempts"), int)
    if failed is None or failed < 1:
        return None
    error, since = doc.get("lastError"), doc.get("since")
    return UploadRetryReport(
        failed_attempts=failed,
        last_error=error if isinstance(error, str) else None,
        step=_number(doc.get("step"), int),
        since=since if isinstance(since, str) else None,
    )


def format_duration(seconds: float) -> str:
    """12m30s style, like kubectl's ages."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


# The trainer's Prometheus gauges on rank 0 (workloads/trainer/tracking.py) -> progress fields.
_METRIC_FIELDS = {
    "loom_trainer_step": "step",
    "loom_trainer_total_steps": "totalSteps",
    "loom_trainer_loss": "loss",
    "loom_trainer_samples_per_second": "samplesPerSecond",
}


def progress_from_metrics(
    text: str, checkpoint_uri: str | None, samples_per_step: int | None = None
) -> ProgressReport | None:
    """Progress from the trainer's Prometheus exposition, for trainers that serve metrics but no JSON.

    The checkpoint URI follows the trainer's layout `<checkpoint.uri>/step-<9 digits>`; without a
    committed checkpoint (gauge 0 or absent) none is reported. The ETA is derived as the trainer does:
    steps left x samples per step (batch size x world size) / samples per second.
    """
    from prometheus_client.parser import text_string_to_metric_families

    doc: dict[str, Any] = {}
    checkpoint_step: int | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for family in families:
        for sample in family.samples:
            if sample.name in _METRIC_FIELDS:
                doc[_METRIC_FIELDS[sample.name]] = sample.value
            elif sample.name == "loom_trainer_checkpoint_step":
                checkpoint_step = int(sample.value)
    if not doc:
        return None
    for key in ("step", "totalSteps"):
        if key in doc:
            doc[key] = int(doc[key])
    rate, step, total = doc.get("samplesPerSecond"), doc.get("step"), doc.get("totalSteps")
    if samples_per_step and rate and step is not None and total is not None:
        doc["eta"] = max(0, total - step) * samples_per_step / rate
    if checkpoint_uri and checkpoint_step:
        doc["latestCheckpoint"] = {
            "uri": f"{checkpoint_uri.rstrip('/')}/step-{checkpoint_step:09d}",
            "step": checkpoint_step,
        }
    return parse_progress(doc)
