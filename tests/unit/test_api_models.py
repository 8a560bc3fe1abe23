"""The API models: wire format, defaults, validation errors with field paths, condition bookkeeping."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loom.operator.api import InferenceService, TrainingJob
from loom.operator.core.model import Condition, set_condition


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


@pytest.mark.parametrize(
    ("spec", "accepted"),
    [
        ({"fsdp": {"sharding": "none"}}, True),
        ({"fsdp": {"sharding": "no"}}, False),  # the trainer's old word; the API's "none" is the one value now
        ({"checkpoint": {"uri": "s3://ckpt/run1", "everyMinutes": 15}}, True),
        ({"checkpoint": {"uri": "s3://ckpt/run1", "everyMinutes": 0.5}}, True),
        ({"checkpoint": {"uri": "s3://ckpt/run1", "everyMinutes": 0}}, False),
        ({"entrypoint": {"module": "pkg.mod:task"}}, True),
        ({"entrypoint": {"module": "pkg.mod"}}, False),  # the trainer needs module:attribute
    ],
)
def test_training_job_admits_what_the_trainer_accepts(spec: dict[str, object], accepted: bool) -> None:
    if accepted:
        TrainingJob.model_validate(training_job(**spec))
    else:
        with pytest.raises(ValidationError):
            TrainingJob.model_validate(training_job(**spec))


def test_defaults_are_the_workloads_defaults() -> None:
    job = TrainingJob.model_validate(training_job(tracking={"mlflow": {"trackingUri": "http://mlflow:5000"}}))
    assert job.spec.tracking is not None and job.spec.tracking.mlflow is not None
    assert job.spec.tracking.mlflow.experiment == "Default"
    isvc = InferenceService.model_validate(
        {"spec": {"model": {"uri": "s3://models/gpt"}, "batching": {"maxBatchSize": 4096}}}
    )
    assert (isvc.spec.batching.max_batch_size, isvc.spec.batching.max_latency_ms) == (4096, 10)
    too_big = {"spec": {"model": {"uri": "s3://models/gpt"}, "batching": {"maxBatchSize": 4097}}}
    with pytest.raises(ValidationError):
        InferenceService.model_validate(too_big)
