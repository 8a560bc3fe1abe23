"""How an InferenceService's reconcile pass reads the replicas the autoscaler asked for (pure).

The autoscaler (loom.operator.autoscale.loop, engine builtin) writes its decision through the scale
subresource, i.e. into spec.replicas, as an HPA (or KEDA's) does. `recommend_replicas` is how the reconcile pass
reads it back: the replicas written there, or None before any was written (the controller then holds
minReplicas). Whatever is returned is clamped to [minReplicas, maxReplicas] by
`rollout.desired_total_replicas`, and split between the stable and
canary tracks by `split_replicas`, so an autoscaler never has to know about canaries.
"""

from __future__ import annotations

from ..api import InferenceServiceSpec


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
