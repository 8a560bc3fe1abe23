"""What the autoscaler reports on the object it scales, the same for every kind (pure): status.autoscaling, the
MetricsAvailable condition and an event per change."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Literal

from ..core.model import Condition, Manifest, format_time
from .decision import Decision
from .spec import Autoscaling, AutoscalingStatus

METRICS_AVAILABLE = "MetricsAvailable"
# Reasons of a scale decision that changed the replicas, and holds worth a warning.
_WARN = {"MetricMissing", "MetricStale", "QueryFailed"}


def ready_pod_names(pods: Iterable[Manifest]) -> list[str]:
    """Serving pods (either track) that are Ready and not going away: the ones whose metric counts."""
    names = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        conditions = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            names.append(str(meta["name"]))
    return sorted(names)


def _iso(unix: float | None) -> str | None:
    return None if unix is None else format_time(datetime.fromtimestamp(unix, UTC))


def autoscaling_status(
    autoscaling: Autoscaling, decision: Decision, previous: AutoscalingStatus | None
) -> AutoscalingStatus:
    """status.autoscaling after `decision`; the last scale is carried over until the next one."""
    last = previous or AutoscalingStatus()
    scaled = decision.changed
    return AutoscalingStatus(
        metric=autoscaling.metric,
        current_replicas=decision.current_replicas,
        desired_replicas=decision.desired_replicas,
        metric_value=None if decision.metric_value is None else round(decision.metric_value, 4),
        metric_timestamp=_iso(decision.metric_timestamp),
        last_scale_time=_iso(decision.state.events[-1].at) if scaled else last.last_scale_time,
        last_scale_reason=decision.reason if scaled else last.last_scale_reason,
        last_scale_message=decision.message if scaled else last.last_scale_message,
    )


def metrics_condition(metric: str, decision: Decision, generation: int | None) -> Condition:
    """MetricsAvailable: False with the reason (MetricMissing, MetricStale, QueryFailed) while the replicas hold."""
    if decision.metric_available:
        return Condition(
            type=METRICS_AVAILABLE,
            status="True",
            reason="MetricsRead",
            message=f"{metric} read from Prometheus",
            observed_generation=generation,
        )
    return Condition(
        type=METRICS_AVAILABLE,
        status="False",
        reason=decision.reason if decision.reason in _WARN else "MetricMissing",
        message=decision.message,
        observed_generation=generation,
    )


EventType = Literal["Normal", "Warning"]


def decision_events(
    decision: Decision, before: Condition | None, after: Condition
) -> list[tuple[EventType, str, str]]:
    """(type, reason, message) of an event for every change of the replicas and of MetricsAvailable's reason."""
    events: list[tuple[EventType, str, str]] = []
    if decision.changed:
        events.append(
            (
                "Normal",
                decision.reason,
                f"replicas {decision.current_replicas} -> {decision.desired_replicas}: {decision.message}",
            )
        )
    if before is None or (before.status, before.reason) != (after.status, after.reason):
        kind: EventType = "Warning" if after.status != "True" else "Normal"
        events.append((kind, after.reason, f"{METRICS_AVAILABLE}={after.status}: {after.message}"))
    return events
