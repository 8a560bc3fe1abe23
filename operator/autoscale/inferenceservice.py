"""Seam for autoscaling InferenceServices; the builtin autoscaler itself comes with a later issue.

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

from ..api.inferenceservice import InferenceServiceSpec


def recommend_replicas(spec: InferenceServiceSpec, current_replicas: int) -> int | None:
    """Replicas the autoscaler wants now, or None (no autoscaler yet: hold minReplicas)."""
    return None
