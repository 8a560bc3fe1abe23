"""FeatureView status (pure): what the apply and materialize Jobs reported and whether the server answers.

The Feast pods write their outcome to the termination-message file (`{"exitCode": 0, ...result}` or
`{"exitCode", "reason", "message"}` with Feast's own message), so a view Feast refuses (unknown dtype, a missing
timestamp column, an unreadable source) becomes the Registered condition's reason and message: the apply Job
fails at once on those exit codes (podFailurePolicy) and is not re-created for the same content, so nothing loops.

Conditions: Registered (the apply Job of the current content succeeded), Materialized (the newest materialization
Job), ServerReady (a feature server replica passes readiness, i.e. answers GET /health), and Ready when the view
is registered and the server answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from cronsim import CronSim, CronSimError

from ...core.kit import Condition, Event, Manifest, format_time, set_condition
from ...core.pod_problems import REASONS as POD_REASONS
from ...core.pod_problems import PodProblem
from .api import FeatureViewStatus, LastMaterialization
from .config import Rejection
from .render import CONTAINER, cron_expression
from .vector.api import VectorSearch
from .vector.status import vector_status

JobState = Literal["Pending", "Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class JobResult:
    """One Job of a view as status needs it: its state and what its pod wrote in the termination message."""

    name: str
    state: JobState
    created: str | None = None
    completed: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    result: dict[str, Any] = field(default_factory=dict)


def _job_condition(job: Manifest, ctype: str) -> Manifest | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype and cond.get("status") == "True":
            return dict(cond)
    return None


def termination_document(pods: list[Manifest]) -> dict[str, Any] | None:
    """The newest terminated Feast container's termination message, parsed (raw text becomes `message`)."""
    newest = sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True)
    for pod in newest:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("name") != CONTAINER:
                continue
            for state in (status.get("state") or {}, status.get("lastState") or {}):
                terminated = state.get("terminated")
                if not terminated:
                    continue
                text = (terminated.get("message") or "").strip()
                try:
                    document = json.loads(text) if text else {}
                except ValueError:
                    document = {"message": text}
                if not isinstance(document, dict):
                    document = {"message": text}
                document.setdefault("exitCode", terminated.get("exitCode"))
                return document
    return None


def job_result(job: Manifest, pods: list[Manifest]) -> JobResult:
    """What a Job of this view did, from the Job's conditions and its pods' termination messages."""
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    document = termination_document(pods) or {}
    state: JobState
    complete, failed = _job_condition(job, "Complete"), _job_condition(job, "Failed")
    if complete is not None or int(status.get("succeeded") or 0) > 0:
        state = "Succeeded"
    elif failed is not None:
        state = "Failed"
    elif int(status.get("active") or 0) > 0:
        state = "Running"
    else:
        state = "Pending"
    reason = document.get("reason")
    message = document.get("message")
    if state == "Failed" and not reason:
        reason = (failed or {}).get("reason") or "Failed"
        message = message or (failed or {}).get("message")
    exit_code = document.get("exitCode")
    return JobResult(
        name=str(meta.get("name")),
        state=state,
        created=meta.get("creationTimestamp"),
        completed=status.get("completionTime") or (failed or {}).get("lastTransitionTime"),
        exit_code=int(exit_code) if isinstance(exit_code, int) else None,
        reason=str(reason) if reason else None,
        message=str(message) if message else None,
        result=document if state == "Succeeded" else {},
    )


def newest(results: list[JobResult]) -> JobResult | None:
    return max(results, key=lambda r: (r.created or "", r.name), default=None)


def next_run(schedule: str, now: datetime) -> datetime | None:
    """The next time the CronJob controller starts a run (schedules are in UTC: the CronJob sets timeZone)."""
    try:
        return next(CronSim(cron_expression(schedule), now.astimezone(UTC).replace(tzinfo=None)))
    except (CronSimError, StopIteration):
        return None


@dataclass(frozen=True)
class Observed:
    generation: int | None
    project: str | None = None  # Feast's project name
    feast_view: str | None = None  # the view's name in Feast ('-' becomes '_')
    feature_refs: tuple[str, ...] = ()  # <feast view>:<feature>, what a lookup names
    registry: str | None = None
    online_store: str | None = None
    url: str | None = None
    online: bool = True
    schedule: str | None = None
    suspended: bool = False
    rejection: Rejection | None = None  # the view is not in the project's config, and why
    apply: JobResult | None = None  # the apply Job of the current content
    waiting_for_writer: bool = False  # another writer of the registry runs; the apply waits for it
    materialization: JobResult | None = None  # the newest materialization Job of the view
    server_replicas: int = 0
    server_ready: int = 0
    # Why a pod of the apply Job / of the feature server cannot start (a missing Secret, ...): pod_problems.
    apply_problem: PodProblem | None = None
    server_problem: PodProblem | None = None
    vector: VectorSearch | None = None  # spec.vector
    embedding_url: str | None = None  # the embedding service's base URL (an embedded view)


def _registered(observed: Observed) -> tuple[Literal["True", "False", "Unknown"], str, str]:
    if observed.rejection is not None:
        return "False", observed.rejection.reason, observed.rejection.message
    job = observed.apply
    if job is None:
        if observed.waiting_for_writer:
            return "Unknown", "WaitingForWriter", "another Job of the project is writing the registry"
        return "Unknown", "Applying", "the apply Job is being created"
    if job.state in ("Pending", "Running"):
        if (problem := observed.apply_problem) is not None:
            return "Unknown", problem.reason, f"Job {job.name} cannot apply the view: {problem.message}"
        return "Unknown", "Applying", f"Job {job.name} applies the view to the registry"
    if job.state == "Failed":
        return "False", job.reason or "Failed", job.message or f"Job {job.name} failed"
    outcome = job.result.get("outcome") or "Applied"
    changes = [c for view in job.result.get("featureViews") or [] for c in view.get("changes") or []]
    detail = f" ({', '.join(str(c) for c in changes)})" if changes else ""
    return "True", "Applied", f"{outcome} in {job.result.get('registry') or observed.registry}{detail}"


def _last_materialization(job: JobResult | None, previous: LastMaterialization | None) -> LastMaterialization | None:
    if job is None:
        return previous
    outcome: Literal["Running", "Succeeded", "Failed"] = (
        "Succeeded" if job.state == "Succeeded" else "Failed" if job.state == "Failed" else "Running"
    )
    if outcome == "Running" and previous is not None and previous.outcome != "Running":
        # Keep showing the last finished window while the next run is under way.
        return previous
    window = job.result.get("window") or {}
    rows = job.result.get("rowsWritten")
    return LastMaterialization(
        start=window.get("start"),
        end=window.get("end"),
        outcome=outcome,
        rows_written=int(rows) if isinstance(rows, int) else None,
        job=job.name,
        message=job.message if outcome == "Failed" else None,
        completion_time=job.completed,
    )


def _materialized(
    observed: Observed, last: LastMaterialization | None, running: bool, next_time: str | None
) -> tuple[Literal["True", "False", "Unknown"], str, str]:
    if not observed.online:
        return "False", "NotOnline", "online: false; the view is not materialized to the online store"
    if last is None or last.outcome == "Running":
        when = f"next scheduled run at {next_time}; " if next_time else ""
        reason = "Materializing" if running else "NotYetMaterialized"
        return "Unknown", reason, f"{when}annotate loom.dev/materialize-now=<token> to run now"
    if last.outcome == "Failed":
        return "False", "MaterializationFailed", last.message or f"Job {last.job} failed"
    rows = "" if last.rows_written is None else f"{last.rows_written} rows, "
    return "True", "Materialized", f"{rows}window {last.start} .. {last.end}"


def _server(observed: Observed) -> tuple[Literal["True", "False", "Unknown"], str, str]:
    if observed.server_replicas == 0:
        return "False", "ScaledToZero", "server.replicas is 0"
    if observed.server_ready > 0:
        return "True", "ServerReady", f"{observed.server_ready}/{observed.server_replicas} ready at {observed.url}"
    if (problem := observed.server_problem) is not None:
        return "False", problem.reason, f"0/{observed.server_replicas} feature server replicas ready: {problem.message}"
    return "False", "ServerStarting", f"0/{observed.server_replicas} feature server replicas ready"


def compute_status(
    observed: Observed, previous: FeatureViewStatus | None, now: datetime
) -> tuple[FeatureViewStatus, list[Event]]:
    """The status to write and the Events its transitions announce."""
    old = previous or FeatureViewStatus()
    conditions = list(old.conditions)
    gen = observed.generation

    def put(ctype: str, value: tuple[Literal["True", "False", "Unknown"], str, str]) -> Condition:
        status, reason, message = value
        cond = Condition(type=ctype, status=status, reason=reason, message=message, observed_generation=gen)
        nonlocal conditions
        conditions = set_condition(conditions, cond, now)
        return cond

    scheduled = observed.online and observed.schedule is not None and not observed.suspended
    upcoming = next_run(observed.schedule, now) if scheduled and observed.schedule else None
    next_time = format_time(upcoming.replace(tzinfo=UTC)) if upcoming else None
    last = _last_materialization(observed.materialization, old.last_materialization)
    running = observed.materialization is not None and observed.materialization.state in ("Pending", "Running")

    finished = observed.materialization
    done = finished is not None and finished.state in ("Succeeded", "Failed")
    vector, vector_condition = vector_status(
        observed.vector,
        url=observed.url or "",
        feast_view=observed.feast_view or "",
        feature_refs=list(observed.feature_refs),
        embedding_url=observed.embedding_url,
        outcome=finished.state if finished is not None and done else None,  # type: ignore[arg-type]
        result=finished.result if finished is not None else {},
        reason=finished.reason if finished is not None else None,
        message=finished.message if finished is not None else None,
        previous=old.vector_search,
    )
    if vector_condition is not None:
        put("VectorIndex", vector_condition)
    registered = put("Registered", _registered(observed))
    put("Materialized", _materialized(observed, last, running, next_time))
    server = put("ServerReady", _server(observed))
    if registered.status == "True" and server.status == "True":
        named = f" as {observed.feast_view}" if observed.feast_view else ""
        ready = put("Ready", ("True", "Ready", f"registered in {observed.project}{named}; serving at {observed.url}"))
    else:
        blocking = registered if registered.status != "True" else server
        ready = put("Ready", ("False", blocking.reason, blocking.message))

    is_registered = registered.status == "True" or (registered.status == "Unknown" and old.registered)
    phase: Literal["Pending", "Registered", "Materializing", "Ready", "Failed"]
    if registered.status == "False":
        phase = "Failed"
    elif ready.status == "True":
        phase = "Ready"
    elif running:
        phase = "Materializing"
    else:
        phase = "Registered" if is_registered else "Pending"
    status = FeatureViewStatus(
        observed_generation=gen,
        conditions=conditions,
        phase=phase,
        registered=is_registered,
        project=observed.project,
        feast_view=observed.feast_view,
        feature_refs=list(observed.feature_refs) or None,
        registry=observed.registry,
        online_store=observed.online_store,
        url=observed.url,
        last_materialization=last,
        next_materialization=next_time,
        # Written by the autoscaler (autoscale/loop.py) on the view whose server autoscaling is in force;
        # carried so this pass never clears it.
        autoscaling=old.autoscaling,
        vector_search=vector,
    )
    return status, _events(old, status)


def _condition(status: FeatureViewStatus, ctype: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == ctype), None)


def _events(old: FeatureViewStatus, new: FeatureViewStatus) -> list[Event]:
    events: list[Event] = []
    before, after = _condition(old, "Registered"), _condition(new, "Registered")
    if after is not None and (before is None or (before.status, before.reason) != (after.status, after.reason)):
        if after.status == "True":
            events.append(Event("Normal", "Registered", after.message))
        elif after.status == "False":
            events.append(Event("Warning", after.reason, after.message))
    last_old, last_new = old.last_materialization, new.last_materialization
    finished = last_new is not None and last_new.outcome in ("Succeeded", "Failed")
    if last_new is not None and finished and (
        last_old is None or (last_old.job, last_old.outcome) != (last_new.job, last_new.outcome)
    ):
        if last_new.outcome == "Succeeded":
            rows = "" if last_new.rows_written is None else f"{last_new.rows_written} rows "
            events.append(
                Event("Normal", "Materialized", f"{rows}for {last_new.start} .. {last_new.end} ({last_new.job})")
            )
        else:
            events.append(Event("Warning", "MaterializationFailed", last_new.message or str(last_new.job)))
    for ctype in ("Registered", "ServerReady"):  # a pod that cannot start: once per cause
        was, now = _condition(old, ctype), _condition(new, ctype)
        if now is not None and now.reason in POD_REASONS and (was is None or was.reason != now.reason):
            events.append(Event("Warning", now.reason, now.message))
    ready_old, ready_new = _condition(old, "Ready"), _condition(new, "Ready")
    if ready_new is not None and ready_new.status == "True" and (ready_old is None or ready_old.status != "True"):
        events.append(Event("Normal", "Ready", ready_new.message))
    elif ready_old is not None and ready_old.status == "True" and ready_new is not None and ready_new.status != "True":
        events.append(Event("Warning", "NotReady", ready_new.message))
    return events
