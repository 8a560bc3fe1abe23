"""The API models: wire format, defaults, validation errors with field paths, condition bookkeeping."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loom.operator.api import InferenceService, TrainingJob
from loom.operator.api.common import Condition, set_condition


def training_job(**spec: object) -> dict[str, object]:
    base: dict[str, object] = {
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
        "workers": {"replicas": 2, "minReplicas": 1},
        "checkpoint": {"uri": "s3://ckpt/run1", "everySteps": 50, "keepLast": 2},
    }
    base.update(spec)
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"}, "spec": base}


def test_camel_case_wire_round_trip() -> None:
    job = TrainingJob.model_validate(training_job())
    assert job.spec.workers.min_replicas == 1
    assert job.spec.checkpoint is not None and job.spec.checkpoint.async_ is True
    wire = job.to_wire()
    assert wire["spec"]["workers"]["minReplicas"] == 1
    assert wire["spec"]["checkpoint"]["async"] is True
    assert wire["spec"]["runPolicy"]["backoffLimit"] == 3
    assert "status" not in wire


def test_unknown_field_is_rejected_with_its_path() -> None:
    bad = training_job(workers={"replicas": 2, "gpus": 1})
    with pytest.raises(ValidationError) as err:
        TrainingJob.model_validate(bad)
    assert ("spec", "workers", "gpus") in [e["loc"] for e in err.value.errors()]


@pytest.mark.parametrize(
    ("spec", "loc"),
    [
        ({"engine": "horovod"}, ("spec", "engine")),
        ({"workers": {"replicas": 0}}, ("spec", "workers", "replicas")),
        ({"checkpoint": {"uri": "gs://bucket/x"}}, ("spec", "checkpoint", "uri")),
        ({"deepspeed": {"zeroStage": 4}}, ("spec", "deepspeed", "zeroStage")),
    ],
)
def test_bad_values_point_at_the_field(spec: dict[str, object], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as err:
        TrainingJob.model_validate(training_job(**spec))
    assert loc in [e["loc"] for e in err.value.errors()]


def test_inference_service_defaults() -> None:
    isvc = InferenceService.model_validate(
        {"spec": {"model": {"uri": "s3://models/gpt"}, "handler": "chargpt"}}
    )
    assert isvc.spec.batching.max_batch_size == 8
    assert isvc.spec.rollout.canary_percent is None
    assert isvc.to_wire()["spec"]["cacheSizeLimit"] == "10Gi"


def test_set_condition_moves_transition_time_only_on_change() -> None:
    first = set_condition([], Condition(type="Ready", status="False", reason="Starting", last_transition_time="t0"))
    same = set_condition(first, Condition(type="Ready", status="False", reason="StillStarting"))
    assert same[0].last_transition_time == "t0" and same[0].reason == "StillStarting"
    flipped = set_condition(same, Condition(type="Ready", status="True", reason="Up"))
    assert flipped[0].last_transition_time != "t0"
    other = set_condition(flipped, Condition(type="Running", status="True", reason="Up"))
    assert [c.type for c in other] == ["Ready", "Running"]
