"""Which Deployments an InferenceService needs now, with which model and how many replicas (pure).

The stable Deployment records the model it serves (annotation `loom.dev/model`), so after any restart the
controller knows the previous version without memory of its own:

- spec model == stable model: one Deployment. A canary left over (after a rollback or a promotion) is removed
  once the stable Deployment is fully rolled out and available, so no traffic is ever left without a replica.
- spec model != stable model, canaryPercent unset or 100: the stable Deployment rolls to the new model
  (a rolling update, bounded by maxSurge/maxUnavailable): that is both a plain update and a canary promotion.
- spec model != stable model, canaryPercent < 100: the stable Deployment keeps the previous model and a canary
  Deployment serves the new one behind the same Service.

Traffic split is replica-weighted: the Service spreads connections over all ready replicas of both tracks, so
the canary gets about canaryReplicas / allReplicas of them. See `split_replicas` for how that approximates the
percentage (at least one canary replica, at least one stable replica).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...core.kit import Manifest
from .api import InferenceServiceSpec
from .source.model import MODEL_ANNOTATION, ModelRef

CanaryAction = Literal["none", "apply", "keep", "retire"]


def split_replicas(total: int, percent: int) -> tuple[int, int]:
    """(stable, canary) replicas approximating `percent` of traffic for the canary.

    canary = round(total * percent / 100), but at least 1 so the new model is actually exercised, and at least
    one stable replica is kept (percent < 100 means "not promoted yet"). With total=1 that is one replica each,
    i.e. 50%: the smallest split that runs both versions. total=0 (scaled to zero) runs nothing.
    """
    if total <= 0:
        return 0, 0
    if percent <= 0:
        return total, 0
    if percent >= 100:
        return 0, total
    if total == 1:
        return 1, 1
    canary = min(total - 1, max(1, int(total * percent / 100 + 0.5)))
    return total - canary, canary


def desired_total_replicas(spec: InferenceServiceSpec, recommendation: int | None = None) -> int:
    """Replicas across both tracks.

    Seam for the autoscaler (loom.operator.autoscale): it will pass its `recommendation`, clamped here to
    autoscaling's [minReplicas, maxReplicas]. Until it exists, autoscaling holds minReplicas.
    """
    if spec.autoscaling is not None:  # spec.replicas then is the autoscaler's, passed as `recommendation`
        # Before the autoscaler wrote any replicas, a service allowed to reach zero still starts with one (as
        # Knative's initial scale): its model is proven to load, and it idles to zero from there.
        wanted = max(1, spec.autoscaling.min_replicas) if recommendation is None else recommendation
        return max(spec.autoscaling.min_replicas, min(spec.autoscaling.max_replicas, wanted))
    # A disaggregated track runs as two pools, each with its own replicas (llm/disaggregation.py, which imports this
    # module through status.py: hence the field read here; admission allows it only with runtime vllm).
    if spec.vllm is not None and (split := spec.vllm.disaggregation) is not None:
        return split.prefill.replicas + split.decode.replicas
    if spec.replicas is not None:
        return spec.replicas
    return 1


def model_of(deployment: Manifest | None) -> ModelRef | None:
    if deployment is None:
        return None
    annotations = deployment.get("metadata", {}).get("annotations") or {}
    return ModelRef.from_annotation(annotations.get(MODEL_ANNOTATION))


def rolled_out(deployment: Manifest | None) -> bool:
    """The Deployment runs only its current template, every wanted replica available (as `kubectl rollout status`)."""
    if deployment is None:
        return False
    wanted = int(deployment.get("spec", {}).get("replicas", 1))
    status = deployment.get("status") or {}
    generation = int(deployment.get("metadata", {}).get("generation", 0))
    if int(status.get("observedGeneration", 0)) < generation:
        return False
    updated = int(status.get("updatedReplicas", 0))
    return (
        updated >= wanted
        and int(status.get("replicas", 0)) == updated
        and int(status.get("availableReplicas", 0)) >= wanted
    )


def available(deployment: Manifest | None) -> int:
    """Replicas of the Deployment's current template available now (0 while it rolls to another template)."""
    if deployment is None:
        return 0
    status = deployment.get("status") or {}
    if int(status.get("observedGeneration", 0)) < int(deployment.get("metadata", {}).get("generation", 0)):
        return 0
    return min(int(status.get("availableReplicas", 0)), int(status.get("updatedReplicas", 0)))


@dataclass(frozen=True)
class RolloutPlan:
    """What to apply. `stable_ref` None: nothing can be rendered yet (no model resolved, nothing running)."""

    stable_ref: ModelRef | None
    stable_replicas: int
    canary_ref: ModelRef | None = None
    canary_replicas: int = 0
    # apply: render the canary; keep: leave it as it is until the stable track is rolled out, then retire it;
    # retire: delete it now (the stable track is rolled out).
    canary_action: CanaryAction = "none"
    canary_percent: int | None = None
    mode: Literal["steady", "canary", "promoting", "rollingBack", "waiting"] = "steady"

    @property
    def serving_ref(self) -> ModelRef | None:
        """The model the spec asks for, once rolled out (the canary's while one runs)."""
        return self.canary_ref if self.canary_action == "apply" else self.stable_ref


def plan_rollout(
    spec: InferenceServiceSpec,
    desired: ModelRef | None,
    stable: Manifest | None,
    canary: Manifest | None,
    total: int,
    percent: int | Literal["spec"] | None = "spec",
    reject_canary: bool = False,
) -> RolloutPlan:
    """Decide the tracks. `desired` None: the spec's model cannot be resolved now; keep what runs.

    `percent`: the canary's share; "spec" reads canaryPercent, the canary analysis passes its step's share (None
    once it promotes or rolls back). `reject_canary`: the canary analysis rejected the canary's model, so it
    leaves at once while a stable replica serves (the stable track grows back alongside), instead of taking its
    share of requests until the stable track is whole again."""
    stable_ref = model_of(stable)
    canary_ref = model_of(canary)
    if desired is None:
        desired = canary_ref or stable_ref
        if desired is None:
            return RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting")
    current = stable_ref or desired
    if percent == "spec":
        percent = spec.rollout.canary_percent
    if desired != current and percent is not None and percent < 100:
        stable_count, canary_count = split_replicas(total, percent)
        return RolloutPlan(
            stable_ref=current,
            stable_replicas=stable_count,
            canary_ref=desired,
            canary_replicas=canary_count,
            canary_action="apply",
            canary_percent=percent,
            mode="canary",
        )
    # One track serves `desired`: a steady state, a plain rolling update, a promotion or a rollback.
    if canary is None:
        return RolloutPlan(stable_ref=desired, stable_replicas=total)
    # The canary held the model now asked for: a promotion; it held another one: a rollback.
    promoting = canary_ref is not None and canary_ref == desired
    mode: Literal["promoting", "rollingBack"] = "promoting" if promoting else "rollingBack"
    # The canary leaves only once the stable track serves every replica: until then it still carries traffic.
    stable_done = (
        stable is not None
        and desired == current
        and int(stable.get("spec", {}).get("replicas", 1)) == total
        and rolled_out(stable)
    )
    if reject_canary and not promoting and desired == current and available(stable) > 0:
        stable_done = True
    return RolloutPlan(
        stable_ref=desired,
        stable_replicas=total,
        canary_ref=canary_ref,
        canary_replicas=int(canary.get("spec", {}).get("replicas", 0)),
        canary_action="retire" if stable_done else "keep",
        mode=mode,
    )
