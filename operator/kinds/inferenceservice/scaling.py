"""The mapping from an InferenceService's spec to the kind-independent autoscaler (pure).

The autoscaler (loom.operator.controllers.autoscaler, engine builtin) writes its decision through the scale
subresource, i.e. into spec.replicas, as an HPA (or KEDA's) does. `recommend_replicas` is how the reconcile pass
reads it back: the replicas written there, or None before any was written (the controller then holds
minReplicas). Whatever is returned is clamped to [minReplicas, maxReplicas] by
`loom.operator.render.inferenceservice_rollout.desired_total_replicas`, and split between the stable and
canary tracks by `split_replicas`, so an autoscaler never has to know about canaries.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Literal

from ...autoscale.decision import DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, Decision, ScalingConfig, ScalingPolicy
from ...autoscale.decision import ScalingRules as DecisionRules
from ...autoscale.promql import MetricQuery, PodSelector, build_query
from ...core.model import Condition, Manifest, format_time
from .api import Autoscaling, AutoscalingStatus, InferenceServiceSpec, ScalingRules

# Without idleSeconds, a service allowed to reach zero goes there after this long without activity.
DEFAULT_IDLE_SECONDS = 300


def recommend_replicas(spec: InferenceServiceSpec, current_replicas: int) -> int | None:
    """Replicas the autoscaler asked for (spec.replicas, written through the scale subresource), or None."""
    if spec.autoscaling is None:
        return None
    return spec.replicas


def current_replicas(spec: InferenceServiceSpec) -> int:
    """Replicas the service runs by its spec: what the autoscaler wrote, else minReplicas (clamped to bounds)."""
    autoscaling = spec.autoscaling
    if autoscaling is None:
        return 1 if spec.replicas is None else spec.replicas
    # Nothing written yet: minReplicas, and one for a service allowed to reach zero (it starts with one).
    wanted = max(1, autoscaling.min_replicas) if spec.replicas is None else spec.replicas
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, wanted))


def _rules(rules: ScalingRules | None, default: DecisionRules) -> DecisionRules:
    if rules is None:
        return default
    policies = default.policies
    if rules.policies is not None:
        policies = tuple(
            ScalingPolicy(
                type="pods" if p.type == "Pods" else "percent", value=p.value, period_seconds=p.period_seconds
            )
            for p in rules.policies
        )
    window = default.stabilization_window_seconds
    if rules.stabilization_window_seconds is not None:
        window = rules.stabilization_window_seconds
    select = {"Max": "max", "Min": "min", "Disabled": "disabled"}[rules.select_policy]
    return DecisionRules.model_validate(
        {"stabilization_window_seconds": window, "policies": policies, "select_policy": select}
    )


def scaling_config(autoscaling: Autoscaling) -> ScalingConfig:
    """The decision's configuration from spec.autoscaling; what the spec leaves out keeps HPA's defaults."""
    return ScalingConfig(
        min_replicas=autoscaling.min_replicas,
        max_replicas=autoscaling.max_replicas,
        target=autoscaling.target,
        tolerance=autoscaling.tolerance,
        scale_up=_rules(autoscaling.scale_up, DEFAULT_SCALE_UP),
        scale_down=_rules(autoscaling.scale_down, DEFAULT_SCALE_DOWN),
        metric_max_age_seconds=autoscaling.metric_max_age_seconds,
        idle_seconds=autoscaling.idle_seconds if autoscaling.idle_seconds is not None else DEFAULT_IDLE_SECONDS,
    )


def metric_query(
    autoscaling: Autoscaling, namespace: str, pod_names: Iterable[str], *, rate_window_seconds: int = 30
) -> MetricQuery:
    """The query for spec.autoscaling.metric over the service's pods (both canary tracks: pass them all).

    Pods are named, not matched by prefix: a service called <name>-canary would share the prefix. A user's
    query (metric prometheus) is used as written; the pods only matter to the other metrics.
    """
    names = list(pod_names)
    if autoscaling.metric == "prometheus" and not names:
        pods = PodSelector(namespace=namespace, pod_regex=".+")  # not part of a user's query
    else:
        pods = PodSelector.for_pods(namespace, names)
    return build_query(
        autoscaling.metric,
        pods,
        promql=autoscaling.query,
        rate_window_seconds=rate_window_seconds,
    )


# ------------------------------------------------------------------------------- what the autoscaler reports

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
