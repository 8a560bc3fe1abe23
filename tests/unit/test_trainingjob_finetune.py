"""TrainingJob spec.finetune: its validation (pydantic and the CRD's CEL rules), the trainer config it renders, and
a base model from another TrainingJob resolved against that job (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.defaults import EndpointDefaults, training_job
from loom.operator.kinds.trainingjob.api import BaseModelStatus, TrainingJobSpec, TrainingJobStatus
from loom.operator.kinds.trainingjob.config import SpecError, trainer_config
from loom.operator.kinds.trainingjob.decision import Observation
from loom.operator.kinds.trainingjob.finetune.base_model import needs_base_job, resolve_base
from loom.operator.kinds.trainingjob.finetune.config import adapter_export_uri
from loom.operator.kinds.trainingjob.state import decide
from loom.workloads.trainer import config as trainer

CHECKPOINT = {"uri": "s3://ckpt/lora", "endpoint": "http://minio:9000"}


def wire(**finetune: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.instructions:task"},
        "checkpoint": dict(CHECKPOINT),
        "finetune": {"baseModel": {"uri": "s3://models/llama"}, **finetune},
    }
    return spec


def spec_of(wire_spec: dict[str, Any]) -> TrainingJobSpec:
    return admitted(TrainingJobSpec, wire_spec)


def test_the_rendered_trainer_config_carries_the_adapter_and_the_base() -> None:
    spec = spec_of(wire(rank=16, alpha=32, dropout=0.1, targetModules=["q_proj", "v_proj"]))
    rendered = json.loads(trainer_config(spec).to_json())
    assert rendered["finetune"] == {
        "method": "lora",
        "baseModel": {"uri": "s3://models/llama"},
        "rank": 16,
        "alpha": 32,
        "dropout": 0.1,
        "targetModules": ["q_proj", "v_proj"],
        "cacheDir": "/tmp/loom-base-model",
    }
    assert rendered["training"]["device"] == "cpu"
    # What the trainer reads back is what the operator meant.
    again = trainer.TrainerConfig.model_validate(rendered)
    assert again.finetune is not None and again.finetune.rank == 16
    assert again.output_uri() == adapter_export_uri(spec) == "s3://ckpt/lora/final"


def test_defaults_are_vllm_servable_attention_projections() -> None:
    finetune = json.loads(trainer_config(spec_of(wire())).to_json())["finetune"]
    assert (finetune["rank"], finetune["alpha"], finetune["dropout"]) == (8, 16, 0.05)
    assert finetune["targetModules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_an_mlflow_base_takes_the_jobs_tracking_uri_or_the_operators_default() -> None:
    with_tracking = wire(baseModel={"mlflow": "models:/llama@champion"})
    with_tracking["tracking"] = {"mlflow": {"trackingUri": "http://mlflow:5000"}}
    rendered = json.loads(trainer_config(spec_of(with_tracking)).to_json())["finetune"]["baseModel"]
    assert rendered == {"mlflow": "models:/llama@champion", "trackingUri": "http://mlflow:5000"}

    bare = spec_of(wire(baseModel={"mlflow": "models:/llama/3"}))
    with pytest.raises(SpecError, match="needs an MLflow tracking URL"):
        trainer_config(bare)
    defaulted = training_job(bare, EndpointDefaults(mlflow_tracking_uri="http://default-mlflow"))
    assert defaulted.used["spec.finetune.baseModel.trackingUri"] == "http://default-mlflow"
    base = json.loads(trainer_config(defaulted.spec).to_json())["finetune"]["baseModel"]
    assert base["trackingUri"] == "http://default-mlflow"
    missing = training_job(bare, EndpointDefaults())
    assert "spec.finetune.baseModel.trackingUri" in (missing.problem() or "")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"finetune": {"method": "qlora", "baseModel": {"uri": "s3://m/b"}}}, "runs on CUDA only"),
        ({"checkpoint": None}, "finetune needs checkpoint"),
        ({"checkpoint": {**CHECKPOINT, "exportFormat": "huggingface"}}, "not a Hugging Face model folder"),
        ({"finetune": {"baseModel": {}}}, "exactly one of uri, mlflow or fromTrainingJob"),
        ({"finetune": {"baseModel": {"uri": "s3://m/b", "fromTrainingJob": {"name": "llama"}}}}, "exactly one"),
        ({"finetune": {"baseModel": {"uri": "s3://m/b"}, "rank": 0}}, "rank"),
        ({"finetune": {"baseModel": {"uri": "s3://m/b"}, "rank": 1024}}, "rank"),
        ({"finetune": {"baseModel": {"uri": "s3://m/b"}, "dropout": 1.0}}, "dropout"),
        ({"finetune": {"baseModel": {"uri": "s3://m/b"}, "targetModules": []}}, "targetModules"),
        ({"finetune": {"baseModel": {"uri": "s3://m/b"}, "targetModules": ["q proj"]}}, "targetModules"),
        ({"finetune": {"baseModel": {"mlflow": "models:/a/b/c"}}}, "mlflow"),
        ({"finetune": {"baseModel": {"uri": "http://m/b"}}}, "uri"),
    ],
)
def test_bad_finetune_specs_are_refused_with_the_reason(change: dict[str, Any], message: str) -> None:
    spec = {**wire(), **change}
    if spec.get("checkpoint") is None:
        spec.pop("checkpoint")
    with pytest.raises(ValidationError, match=message):
        spec_of(spec)


def test_qlora_is_accepted_on_gpu_workers_and_renders_for_cuda() -> None:
    spec = spec_of({**wire(method="qlora"), "workers": {"gpusPerWorker": 1}})
    rendered = trainer_config(spec)
    assert rendered.finetune is not None and rendered.finetune.method == "qlora"
    assert rendered.training.device == "cuda"
    # The trainer's own model refuses the same on CPU (a config written by hand).
    with pytest.raises(ValidationError, match="CUDA only"):
        trainer.TrainerConfig.model_validate({**rendered.model_dump(by_alias=True), "training": {"device": "cpu"}})


def _cel_rules(schema: dict[str, Any]) -> dict[str, Any]:
    import cel

    return {e["message"]: cel.compile(e["rule"]) for e in schema.get("x-kubernetes-validations", [])
            if "oldSelf" not in e["rule"]}


def test_the_crds_cel_rules_refuse_the_same_specs() -> None:
    from loom.operator.api.crd import crd_for
    from loom.operator.api.kinds import TRAINING_JOB

    schema = crd_for(TRAINING_JOB)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = _cel_rules(schema)

    def failing(spec: dict[str, Any]) -> set[str]:
        return {message for message, program in rules.items() if program.execute({"self": spec}) is False}

    good = wire()
    good["workers"] = {"replicas": 1, "gpusPerWorker": 0}
    assert failing(good) == set()
    assert failing({**good, "finetune": {**good["finetune"], "method": "qlora"}}) == {trainer.QLORA_NEEDS_GPU}
    assert failing({**good, "finetune": {**good["finetune"], "method": "qlora"},
                    "workers": {"replicas": 1, "gpusPerWorker": 2}}) == set()
    assert failing({k: v for k, v in good.items() if k != "checkpoint"}) == {
        "finetune needs checkpoint: the adapter is checkpointed under checkpoint.uri and exported to "
        "<checkpoint.uri>/final"}
    assert failing({**good, "checkpoint": {**CHECKPOINT, "exportFormat": "huggingface"}}) == {
        trainer.FINETUNE_EXPORTS_ADAPTER}
    base_rules = _cel_rules(schema["properties"]["finetune"]["properties"]["baseModel"])
    (one_source,) = base_rules.values()
    assert one_source.execute({"self": {"uri": "s3://m/b"}}) is True
    assert one_source.execute({"self": {"uri": "s3://m/b", "mlflow": "models:/a/1"}}) is False
    assert one_source.execute({"self": {}}) is False


def base_job(phase: str | None, **checkpoint: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "llama", "namespace": "ns"},
        "spec": {"engine": "fsdp", "checkpoint": {"uri": "s3://ckpt/llama", "endpoint": "http://other:9000",
                                                  "exportFormat": "huggingface", **checkpoint}},
        "status": {"phase": phase} if phase else {},
    }


FROM_JOB = {"fromTrainingJob": {"name": "llama"}}


def test_a_base_from_another_trainingjob_is_its_final_export_once_it_succeeded() -> None:
    spec = spec_of(wire(baseModel=FROM_JOB))
    assert needs_base_job(spec, TrainingJobStatus()) == "llama"
    resolved = resolve_base(spec, base_job("Succeeded"))
    assert resolved.error is None and resolved.wait is None and resolved.spec is not None
    assert resolved.status == BaseModelStatus(training_job="llama", uri="s3://ckpt/llama/final",
                                              endpoint="http://other:9000")
    base = json.loads(trainer_config(resolved.spec).to_json())["finetune"]["baseModel"]
    assert base == {"uri": "s3://ckpt/llama/final", "endpoint": "http://other:9000"}
    # Recorded once: later passes read status, not the other job (which may have changed or gone).
    assert needs_base_job(spec, TrainingJobStatus(base_model=resolved.status)) is None
    other = BaseModelStatus(training_job="older", uri="s3://ckpt/older/final")
    assert needs_base_job(spec, TrainingJobStatus(base_model=other)) == "llama"  # renamed while Pending: read again
    # Unresolved, nothing can render: the controller never gets that far (it waits first).
    with pytest.raises(SpecError, match="not resolved"):
        trainer_config(spec)


@pytest.mark.parametrize(
    ("job", "wait", "error"),
    [
        (None, "BaseModelNotFound", None),
        (base_job(None), "WaitingForBaseModel", None),
        (base_job("Running"), "WaitingForBaseModel", None),
        (base_job("Failed"), None, "failed"),
        (base_job("Succeeded", exportFormat="loom"), None, "not a Hugging Face folder"),
        ({"spec": {"checkpoint": {}}, "status": {"phase": "Succeeded"}}, None, "no spec.checkpoint"),
        ({**base_job("Succeeded"), "spec": {**base_job(None)["spec"], "finetune": {"rank": 8}}}, None,
         "fine-tunes an adapter"),
    ],
)
def test_a_base_job_that_is_not_ready_waits_or_fails_with_the_reason(
    job: dict[str, Any] | None, wait: str | None, error: str | None
) -> None:
    resolved = resolve_base(spec_of(wire(baseModel=FROM_JOB)), job)
    assert resolved.spec is None
    assert (resolved.wait[0] if resolved.wait else None) == wait
    assert (error is None) == (resolved.error is None)
    if error is not None:
        assert error in (resolved.error or "")


def test_waiting_for_the_base_keeps_the_job_pending_with_the_reason() -> None:
    spec = spec_of(wire(baseModel=FROM_JOB))
    decision = decide(Observation(generation=1, spec=spec, status=TrainingJobStatus(), pods=(), now=datetime.now(UTC),
                                  base_wait=("WaitingForBaseModel", "TrainingJob llama is Running")))
    assert decision.status.phase == "Pending" and not decision.create
    ready = next(c for c in decision.status.conditions or [] if c.type == "Ready")
    assert (ready.reason, ready.message) == ("WaitingForBaseModel", "TrainingJob llama is Running")
