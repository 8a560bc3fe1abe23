"""What an object asks of the autoscaler (`spec.autoscaling` of an InferenceService, `spec.router.autoscaling` of an
InferenceGraph, `spec.server.autoscaling` of a FeatureView: the same model) and what it reads back
(`status.autoscaling`), and how the spec becomes the pure decision's configuration and its Prometheus query.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field

from ..core.model import ApiModel, cel, validations
from .decision import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    PolicyPeriodSeconds,
    PolicyValue,
    ScalingConfig,
    StabilizationWindowSeconds,
)
from .decision import ScalingPolicy as DecisionPolicy
from .decision import ScalingRules as DecisionRules
from .promql import MetricQuery, PodSelector, build_query

# Without idleSeconds, a service allowed to reach zero goes there after this long without activity.
DEFAULT_IDLE_SECONDS = 300


class ScalingPolicy(ApiModel):
    """At most `value` pods, or `value` percent of the replicas at the period's start, per period (as an HPA)."""

    type: Literal["Pods", "Percent"]
    value: PolicyValue = Field(le=10000)
    period_seconds: PolicyPeriodSeconds = Field(description="How far back changes count against this policy.")


class ScalingRules(ApiModel):
    """One direction's behaviour, as autoscaling/v2 HPAScalingRules: a stabilization window and rate limits."""

    stabilization_window_seconds: StabilizationWindowSeconds | None = Field(
        None,
        description="Act on the least extreme recommendation of this many seconds (default: 0 up, 300 down).",
    )
    policies: list[ScalingPolicy] | None = Field(
        None,
        min_length=1,
        max_length=10,
        description="Rate limits (default: up 4 pods or 100% per 15s, the larger; down 100% per 15s).",
    )
    select_policy: Literal["Max", "Min", "Disabled"] = Field(
        "Max", description="Max: the policy allowing the biggest change wins; Min: the smallest; Disabled: never."
    )


AutoscalingMetric = Literal[
    "gpu-utilization", "gpu-memory", "queue-depth", "concurrency", "requests-per-second", "prometheus",
    "llm-waiting-requests", "llm-kv-cache-usage", "llm-ttft-p95",
]


class Autoscaling(ApiModel):
    """Scale replicas on a metric read from Prometheus (the HPA algorithm); stabilization windows and rate limits
    keep it from flapping, and missing or stale metrics hold the replicas (never scale down).

    With engine builtin (and keda/hpa) the replica count is written through the scale subresource
    (spec.replicas), as an HPA does: leave spec.replicas out of what GitOps applies.
    """

    model_config = validations(
        cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas", field_path=".minReplicas"),
        cel(
            "self.metric == 'prometheus' ? has(self.query) : !has(self.query)",
            "query is required for metric prometheus and only allowed with it",
            field_path=".query",
        ),
        cel(
            "!has(self.idleSeconds) || self.minReplicas == 0",
            "idleSeconds needs minReplicas 0 (scale to zero)",
            field_path=".idleSeconds",
        ),
    )

    min_replicas: int = Field(1, ge=0, le=1000, description="Fewest replicas (0 allows scale to zero).")
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas.")
    metric: AutoscalingMetric = Field(
        "concurrency",
        description="What drives scaling: gpu-utilization and gpu-memory (percent, dcgm-exporter series), "
        "queue-depth and concurrency (requests per replica), requests-per-second (per replica), prometheus "
        "(the user's query: one number for the whole service), or for runtime vllm llm-waiting-requests "
        "(requests the engine queues), llm-kv-cache-usage (percent of the KV cache in use) and llm-ttft-p95 "
        "(seconds to the first token, 95th percentile).",
    )
    query: str | None = Field(
        None, min_length=1, max_length=4096, description="PromQL for metric prometheus (a vector is summed)."
    )
    target: float = Field(gt=0, description="Per-replica target of the metric (percent for GPU metrics).")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while |value / target - 1| <= tolerance.")
    scale_up: ScalingRules | None = Field(None, description="Scale-up window and rate limits.")
    scale_down: ScalingRules | None = Field(None, description="Scale-down window and rate limits.")
    idle_seconds: int | None = Field(
        None, ge=1, le=86400, description="With minReplicas 0: no activity for this long scales to zero (300)."
    )
    metric_max_age_seconds: int = Field(
        60, ge=1, le=3600, description="Older samples are stale: the replicas hold and MetricsAvailable is False."
    )
    engine: Literal["builtin", "keda", "hpa"] = Field(
        "builtin", description="Who scales: Loom itself, KEDA, or an HPA."
    )


class AutoscalingStatus(ApiModel):
    """The autoscaler's last look: the metric it saw, what it wants, and its last change."""

    metric: str | None = Field(None, description="The metric scaled on.")
    current_replicas: int | None = Field(None, description="Replicas asked for when it last decided.")
    desired_replicas: int | None = Field(None, description="Replicas it wants now.")
    metric_value: float | None = Field(
        None, description="Metric value seen (per replica; the whole service's for metric prometheus)."
    )
    metric_timestamp: str | None = Field(None, description="When that value was sampled (RFC 3339).")
    last_scale_time: str | None = Field(None, description="When it last changed the replicas (RFC 3339).")
    last_scale_reason: str | None = Field(None, description="Why, e.g. ScaledUp, ScaledDown, ScaledToZero.")
    last_scale_message: str | None = None


def _rules(rules: ScalingRules | None, default: DecisionRules) -> DecisionRules:
    if rules is None:
        return default
    policies = default.policies
    if rules.policies is not None:
        policies = tuple(
            DecisionPolicy(
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
