"""Seam for autoscaling InferenceServices, and the mapping from its spec to the kind-independent autoscaler.

Each reconcile pass asks `recommend_replicas` how many replicas (both canary tracks together) the service
should run. None means "no recommendation": the controller then holds spec.autoscaling.minReplicas.
Whatever is returned is clamped to [minReplicas, maxReplicas] by
`loom.operator.render.inferenceservice_rollout.desired_total_replicas`, and split between the stable and
canary tracks by `split_replicas`, so an autoscaler never has to know about canaries.

What the builtin engine will do here: read spec.autoscaling.metric for the serving pods (the servers'
/metrics and dcgm-exporter names through Prometheus), divide by spec.autoscaling.target, and apply the
scale-up/scale-down stabilization windows. Engines `keda` and `hpa` will instead render their own objects
and leave the replica count to them (the controller must then stop setting Deployment replicas).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..api.inferenceservice import Autoscaling, InferenceServiceSpec
from .decision import DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, ScalingConfig
from .promql import MetricQuery, PodSelector, build_query


def recommend_replicas(spec: InferenceServiceSpec, current_replicas: int) -> int | None:
    """Replicas the autoscaler wants now, or None (no autoscaler yet: hold minReplicas)."""
    return None


def scaling_config(autoscaling: Autoscaling) -> ScalingConfig:
    """The decision's configuration from spec.autoscaling; what the API cannot say yet keeps HPA's defaults."""
    return ScalingConfig(
        min_replicas=autoscaling.min_replicas,
        max_replicas=autoscaling.max_replicas,
        target=autoscaling.target,
        scale_up=DEFAULT_SCALE_UP.model_copy(
            update={"stabilization_window_seconds": autoscaling.scale_up_stabilization_seconds}
        ),
        scale_down=DEFAULT_SCALE_DOWN.model_copy(
            update={"stabilization_window_seconds": autoscaling.scale_down_stabilization_seconds}
        ),
    )


def metric_query(autoscaling: Autoscaling, namespace: str, pod_names: Iterable[str]) -> MetricQuery:
    """The query for spec.autoscaling.metric over the service's pods (both canary tracks: pass them all).

    Pods are named, not matched by prefix: a service called <name>-canary would share the prefix.
    """
    return build_query(autoscaling.metric, PodSelector.for_pods(namespace, pod_names))
