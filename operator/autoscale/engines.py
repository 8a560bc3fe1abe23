"""Engines keda and hpa: the object that scales a workload instead of Loom (pure; no kind, no I/O).

Both target the owner's scale subresource (`scaleTargetRef`), so they write the same replica count the builtin
engine would, and Loom then never writes replicas itself. Both carry the same behaviour (windows, policies,
select policy) as the builtin decision, in autoscaling/v2's words.

- keda: a ScaledObject (keda.sh/v1alpha1) with one Prometheus trigger. The query is the builtin engine's
  per-pod query summed over the workload's pods, with `metricType: AverageValue`: the HPA KEDA drives divides it
  by the replicas, i.e. the same per-replica target. A user's query (metric prometheus) is one number for the
  workload already and is used as written. minReplicas 0 gives KEDA's scale to zero (idleSeconds ->
  cooldownPeriod).
- hpa: an autoscaling/v2 HorizontalPodAutoscaler on Pods metrics, which need a metrics adapter (e.g. Prometheus
  Adapter) exposing the series under the names below per pod. gpu-memory (a ratio of two series) and a user's
  PromQL have no single series to name: use engine keda or builtin for them. An HPA cannot go below 1 replica
  without the HPAScaleToZero feature gate, so minReplicas 0 becomes 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.model import Manifest
from .decision import ScalingConfig, ScalingRules
from .promql import GPU_UTIL, INFLIGHT, QUEUE_DEPTH, MetricKind, PodSelector, build_query

# Pods metrics as a Prometheus Adapter exposes them by default (counters: <name>_total -> <name>_per_second).
HPA_POD_METRICS: dict[MetricKind, str] = {
    "gpu-utilization": GPU_UTIL,
    "queue-depth": QUEUE_DEPTH,
    "concurrency": INFLIGHT,
    "requests-per-second": "loom_server_requests_per_second",
}
KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
# How often KEDA asks Prometheus (its default is 30 s; the builtin engine decides every 5 s).
KEDA_POLLING_INTERVAL_S = 10


class EngineError(ValueError):
    """The spec asks an engine for something it cannot do (reported as a condition, never a crash)."""


def quantity(value: float) -> str:
    """A Kubernetes quantity for a target: whole numbers as written, fractions in milli-units."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def decimal(value: float) -> str:
    """A number as KEDA's trigger metadata takes it (parsed as a JSON number: "2.5", never a quantity "2500m")."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def pods_of(namespace: str, deployments: Sequence[str]) -> PodSelector:
    """Every pod the Deployments create (<deployment>-<template hash>-<5 characters>), whichever is running."""
    if not deployments:
        raise EngineError("no Deployment to scale")
    names = "|".join(PodSelector.for_owner(namespace, d).pod_regex for d in sorted(deployments))
    return PodSelector(namespace=namespace, pod_regex=names)


def behavior(config: ScalingConfig) -> Manifest:
    """autoscaling/v2 HorizontalPodAutoscalerBehavior from the decision's rules."""

    def rules(r: ScalingRules) -> Manifest:
        out: Manifest = {
            "stabilizationWindowSeconds": r.stabilization_window_seconds,
            "selectPolicy": r.select_policy.capitalize(),
        }
        if r.policies:
            out["policies"] = [
                {"type": p.type.capitalize(), "value": p.value, "periodSeconds": p.period_seconds} for p in r.policies
            ]
        return out

    return {"scaleUp": rules(config.scale_up), "scaleDown": rules(config.scale_down)}


def render_scaled_object(
    metadata: Manifest,
    target: Manifest,
    config: ScalingConfig,
    kind: MetricKind,
    deployments: Sequence[str],
    *,
    prometheus_url: str,
    promql: str | None = None,
    rate_window_seconds: int = 30,
) -> Manifest:
    """A KEDA ScaledObject scaling `target` (apiVersion, kind, name) on `kind`, read from `prometheus_url`."""
    if not prometheus_url.startswith(("http://", "https://")):
        raise EngineError(
            f"engine keda needs the Prometheus URL (operator setting LOOM_PROMETHEUS_URL), got {prometheus_url!r}"
        )
    query = build_query(
        kind, pods_of(metadata["namespace"], deployments), promql=promql, rate_window_seconds=rate_window_seconds
    )
    total = query.value if query.scope == "workload" else f"sum({query.value})"
    trigger: Manifest = {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": prometheus_url,
            "query": total,
            "threshold": decimal(config.target),
            "activationThreshold": decimal(config.activation_threshold),
        },
    }
    spec: Manifest = {
        "scaleTargetRef": dict(target),
        "minReplicaCount": config.min_replicas,
        "maxReplicaCount": config.max_replicas,
        "pollingInterval": KEDA_POLLING_INTERVAL_S,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(config)}},
        "triggers": [trigger],
    }
    if config.min_replicas == 0:
        spec["cooldownPeriod"] = int(config.idle_seconds)
    return {"apiVersion": KEDA_API_VERSION, "kind": "ScaledObject", "metadata": metadata, "spec": spec}


def render_hpa(metadata: Manifest, target: Manifest, config: ScalingConfig, kind: MetricKind) -> Manifest:
    """An autoscaling/v2 HorizontalPodAutoscaler scaling `target` on a per-pod metric from a metrics adapter."""
    name = HPA_POD_METRICS.get(kind)
    if name is None:
        raise EngineError(
            f"engine hpa cannot scale on {kind}: it has no single per-pod series for a metrics adapter "
            "(use engine builtin or keda)"
        )
    metric = {
        "type": "Pods",
        "pods": {"metric": {"name": name}, "target": {"type": "AverageValue", "averageValue": quantity(config.target)}},
    }
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": dict(target),
            "minReplicas": max(1, config.min_replicas),
            "maxReplicas": config.max_replicas,
            "metrics": [metric],
            "behavior": behavior(config),
        },
    }
