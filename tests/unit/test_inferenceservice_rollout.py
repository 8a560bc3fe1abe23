"""Canary planning: replica split, promotion, rollback, and what counts as rolled out."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.rollout import (
    desired_total_replicas,
    plan_rollout,
    rolled_out,
    split_replicas,
)
from loom.operator.kinds.inferenceservice.source.model import MODEL_ANNOTATION, ModelRef


@pytest.mark.parametrize(
    ("total", "percent", "expected"),
    [
        (5, 20, (4, 1)),  # exact
        (10, 20, (8, 2)),
        (4, 20, (3, 1)),  # 25%: nearest achievable
        (10, 25, (7, 3)),  # 2.5 rounds half up
        (10, 1, (9, 1)),  # at least one canary replica, or the new model is never exercised
        (1, 20, (1, 1)),  # one replica asked: both versions still run (50%)
        (2, 90, (1, 1)),  # at least one stable replica until promoted
        (3, 99, (1, 2)),
        (5, 0, (5, 0)),  # 0%: the canary is staged without traffic
        (0, 20, (0, 0)),  # scaled to zero
        (4, 100, (0, 4)),
    ],
)
def test_split_replicas(total: int, percent: int, expected: tuple[int, int]) -> None:
    assert split_replicas(total, percent) == expected


def test_split_share_approximates_the_percentage_for_reasonable_sizes() -> None:
    for total in range(5, 40):
        for percent in range(5, 96, 5):
            stable, canary = split_replicas(total, percent)
            assert stable + canary == total
            assert stable >= 1 and canary >= 1
            if stable > 1 and canary > 1:  # not held at the one-replica floor of either track: nearest split
                assert abs(canary / total * 100 - percent) <= 100 / total / 2 + 1e-9


def spec(canary: int | None = None, replicas: int | None = 5, **extra: Any) -> InferenceServiceSpec:
    wire: dict[str, Any] = {"model": {"uri": "s3://m/v2"}, "handler": "noop", **extra}
    if replicas is not None:
        wire["replicas"] = replicas
    if canary is not None:
        wire["rollout"] = {"canaryPercent": canary}
    return InferenceServiceSpec.model_validate(wire)


def ref(version: str) -> ModelRef:
    return ModelRef(storage_uri=f"s3://m/{version}", storage_kind="s3", handler="noop", version=version)


def deployment(model: ModelRef | None, replicas: int, *, done: bool = True, generation: int = 2) -> dict[str, Any]:
    annotations = {MODEL_ANNOTATION: model.to_annotation()} if model else {}
    status = (
        {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
         "readyReplicas": replicas, "availableReplicas": replicas}
        if done
        else {"observedGeneration": generation - 1, "replicas": replicas + 1, "updatedReplicas": 1,
              "readyReplicas": replicas, "availableReplicas": replicas}
    )  # fmt: skip
    return {
        "metadata": {"generation": generation, "annotations": annotations},
        "spec": {"replicas": replicas},
        "status": status,
    }


def test_desired_total_replicas() -> None:
    assert desired_total_replicas(spec(replicas=3)) == 3
    assert desired_total_replicas(spec(replicas=None)) == 1
    auto = spec(replicas=None, autoscaling={"minReplicas": 2, "maxReplicas": 6, "target": 70})
    assert desired_total_replicas(auto) == 2
    # The autoscaler's seam: its recommendation is clamped to [min, max].
    assert desired_total_replicas(auto, recommendation=9) == 6
    assert desired_total_replicas(auto, recommendation=4) == 4
    assert desired_total_replicas(auto, recommendation=0) == 2


def test_first_creation_with_canary_percent_has_nothing_to_compare_with() -> None:
    plan = plan_rollout(spec(canary=20), ref("v2"), None, None, 5)
    assert (plan.stable_ref, plan.stable_replicas, plan.canary_action) == (ref("v2"), 5, "none")


def test_model_change_without_canary_is_a_rolling_update_of_the_stable_track() -> None:
    plan = plan_rollout(spec(), ref("v2"), deployment(ref("v1"), 5), None, 5)
    assert (plan.stable_ref, plan.stable_replicas, plan.canary_action) == (ref("v2"), 5, "none")


def test_model_change_with_canary_keeps_the_previous_model_stable() -> None:
    plan = plan_rollout(spec(canary=20), ref("v2"), deployment(ref("v1"), 5), None, 5)
    assert plan.mode == "canary"
    assert (plan.stable_ref, plan.stable_replicas) == (ref("v1"), 4)
    assert (plan.canary_ref, plan.canary_replicas, plan.canary_action) == (ref("v2"), 1, "apply")
    assert plan.serving_ref == ref("v2")


def test_canary_survives_an_operator_restart() -> None:
    # Everything the plan needs is in the live Deployments: a fresh operator reaches the same plan.
    live_stable, live_canary = deployment(ref("v1"), 4), deployment(ref("v2"), 1)
    plan = plan_rollout(spec(canary=20), ref("v2"), live_stable, live_canary, 5)
    assert (plan.stable_ref, plan.canary_ref, plan.canary_action) == (ref("v1"), ref("v2"), "apply")


def test_promotion_rolls_stable_forward_then_retires_the_canary() -> None:
    canary = deployment(ref("v2"), 1)
    # canaryPercent removed: the stable track takes the new model; the canary keeps serving meanwhile.
    plan = plan_rollout(spec(canary=None), ref("v2"), deployment(ref("v1"), 4), canary, 5)
    assert (plan.stable_ref, plan.stable_replicas, plan.canary_action, plan.mode) == (ref("v2"), 5, "keep", "promoting")
    # Stable annotated with v2 but still rolling: keep.
    rolling = deployment(ref("v2"), 5, done=False)
    assert plan_rollout(spec(canary=None), ref("v2"), rolling, canary, 5).canary_action == "keep"
    # Rolled out on every replica: retire.
    done = plan_rollout(spec(canary=None), ref("v2"), deployment(ref("v2"), 5), canary, 5)
    assert (done.canary_action, done.mode) == ("retire", "promoting")
    # canaryPercent 100 is a promotion too.
    assert plan_rollout(spec(canary=100), ref("v2"), deployment(ref("v2"), 5), canary, 5).canary_action == "retire"


def test_promotion_waits_for_the_stable_track_to_reach_full_size() -> None:
    stable_at_canary_size = deployment(ref("v2"), 4)
    plan = plan_rollout(spec(canary=None), ref("v2"), stable_at_canary_size, deployment(ref("v2"), 1), 5)
    assert plan.canary_action == "keep"


def test_rollback_sets_the_spec_back_and_removes_the_canary() -> None:
    plan = plan_rollout(spec(canary=20), ref("v1"), deployment(ref("v1"), 4), deployment(ref("v2"), 1), 5)
    assert plan.mode == "rollingBack"
    assert (plan.stable_ref, plan.stable_replicas) == (ref("v1"), 5)
    # The stable track first grows back to 5 (generation bumped, not observed yet): keep the canary meanwhile.
    assert plan.canary_action == "keep"
    full = plan_rollout(spec(canary=20), ref("v1"), deployment(ref("v1"), 5), deployment(ref("v2"), 1), 5)
    assert full.canary_action == "retire"


def test_a_rejected_canary_leaves_at_once_while_a_stable_replica_serves() -> None:
    stable, canary = deployment(ref("v1"), 4), deployment(ref("v2"), 1)
    plan = plan_rollout(spec(canary=20), ref("v1"), stable, canary, 5, None, reject_canary=True)
    assert (plan.mode, plan.stable_replicas, plan.canary_action) == ("rollingBack", 5, "retire")
    # No stable replica available (its template still rolling): the canary keeps serving until one is.
    rolling = deployment(ref("v1"), 4, done=False)
    rolling["status"]["updatedReplicas"] = 0
    plan = plan_rollout(spec(canary=20), ref("v1"), rolling, canary, 5, None, reject_canary=True)
    assert plan.canary_action == "keep"
    # A promotion is never cut short by it.
    plan = plan_rollout(spec(canary=20), ref("v2"), deployment(ref("v2"), 4, done=False), canary, 5, None,
                        reject_canary=True)  # fmt: skip
    assert (plan.mode, plan.canary_action) == ("promoting", "keep")


def test_a_third_version_replaces_the_canary_not_the_stable() -> None:
    plan = plan_rollout(spec(canary=20), ref("v3"), deployment(ref("v1"), 4), deployment(ref("v2"), 1), 5)
    assert (plan.stable_ref, plan.canary_ref, plan.canary_action) == (ref("v1"), ref("v3"), "apply")


def test_unresolvable_model_keeps_what_runs() -> None:
    assert plan_rollout(spec(), None, None, None, 5).stable_ref is None
    plan = plan_rollout(spec(), None, deployment(ref("v1"), 5), None, 5)
    assert (plan.stable_ref, plan.canary_action) == (ref("v1"), "none")
    # A running canary keeps running with its split.
    kept = plan_rollout(spec(canary=20), None, deployment(ref("v1"), 4), deployment(ref("v2"), 1), 5)
    assert (kept.stable_ref, kept.canary_ref, kept.canary_action) == (ref("v1"), ref("v2"), "apply")


def test_stable_deployment_without_a_readable_annotation_takes_the_spec_model() -> None:
    plan = plan_rollout(spec(canary=20), ref("v2"), deployment(None, 5), None, 5)
    assert (plan.stable_ref, plan.canary_action) == (ref("v2"), "none")


def test_rolled_out() -> None:
    assert rolled_out(deployment(ref("v1"), 3))
    assert not rolled_out(deployment(ref("v1"), 3, done=False))
    assert not rolled_out(None)
    unobserved = deployment(ref("v1"), 3)
    unobserved["metadata"]["generation"] = 3
    assert not rolled_out(unobserved)
    scaled_to_zero = {"metadata": {"generation": 1}, "spec": {"replicas": 0}, "status": {"observedGeneration": 1}}
    assert rolled_out(scaled_to_zero)
