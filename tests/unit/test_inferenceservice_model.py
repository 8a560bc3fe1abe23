"""Resolving an InferenceService's model source (uri, MLflow, fromTrainingJob) to one concrete ModelRef."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.kinds.inferenceservice.source.api import ModelSource
from loom.operator.kinds.inferenceservice.source.model import ModelRef, ResolveError, resolve_model


def source(**wire: Any) -> ModelSource:
    return ModelSource.model_validate(wire)


def training_job(phase: str = "Running", latest: str | None = None, step: int | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if latest:
        status["checkpoint"] = {"latest": latest, "step": step}
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {
            "checkpoint": {
                "uri": "s3://ckpt/train",
                "endpoint": "http://s3:9000",
                "secretRef": {"name": "job-creds", "accessKeyIdKey": "id", "secretAccessKeyKey": "secret"},
            }
        },
        "status": status,
    }


def test_uri_version_defaults_to_its_last_segment_and_explicit_wins() -> None:
    ref = resolve_model(source(uri="s3://models/gpt/v2/"), "noop")
    assert (ref.storage_uri, ref.storage_kind, ref.version, ref.handler) == ("s3://models/gpt/v2/", "s3", "v2", "noop")
    assert resolve_model(source(uri="s3://models/gpt/v2", version="2024.1"), "noop").version == "2024.1"


def test_mlflow_number_is_the_version_and_an_alias_is_left_to_the_fetch_step() -> None:
    ref = resolve_model(source(mlflow="models:/gpt/7", trackingUri="http://mlflow:5000"), "auto")
    assert (ref.storage_kind, ref.version, ref.handler, ref.tracking_uri) == (
        "mlflow", "7", "mlflow-pyfunc", "http://mlflow:5000",
    )  # fmt: skip
    alias = resolve_model(source(mlflow="models:/gpt@champion"), "auto")
    assert alias.version is None
    assert alias.display_version == "models:/gpt@champion"


def test_auto_handler_for_a_plain_uri_needs_a_choice() -> None:
    with pytest.raises(ResolveError) as caught:
        resolve_model(source(uri="s3://models/gpt"), "auto")
    assert caught.value.reason == "HandlerRequired" and not caught.value.transient


def test_training_job_latest_checkpoint_with_its_store_settings() -> None:
    job = training_job(latest="s3://ckpt/train/step-00000200/", step=200)
    ref = resolve_model(source(fromTrainingJob={"name": "train"}), "auto", job)
    assert ref.storage_uri == "s3://ckpt/train/step-00000200/"
    assert ref.storage_kind == "s3"
    assert ref.version == "step-200"
    assert ref.handler == "chargpt"
    assert ref.endpoint == "http://s3:9000"
    assert ref.secret_ref is not None and ref.secret_ref.name == "job-creds"
    assert ref.secret_ref.access_key_id_key == "id"


def test_a_newer_checkpoint_is_a_different_model() -> None:
    spec = source(fromTrainingJob={"name": "train"})
    old = resolve_model(spec, "chargpt", training_job(latest="s3://ckpt/train/step-100/", step=100))
    new = resolve_model(spec, "chargpt", training_job(latest="s3://ckpt/train/step-200/", step=200))
    same = resolve_model(spec, "chargpt", training_job(latest="s3://ckpt/train/step-100/", step=100))
    assert old != new
    assert old == same


def test_own_secret_and_endpoint_win_over_the_jobs() -> None:
    spec = source(fromTrainingJob={"name": "train"}, endpoint="http://other:9000", secretRef={"name": "mine"})
    ref = resolve_model(spec, "chargpt", training_job(latest="s3://ckpt/train/step-1/", step=1))
    assert ref.endpoint == "http://other:9000"
    assert ref.secret_ref is not None and ref.secret_ref.name == "mine"


@pytest.mark.parametrize(
    ("job", "checkpoint", "reason"),
    [
        (None, "latest", "TrainingJobNotFound"),
        (training_job("Running"), "latest", "NoCheckpointYet"),
        (training_job("Running", "s3://ckpt/train/step-5/", 5), "final", "WaitingForTrainingJob"),
        (training_job("Failed", "s3://ckpt/train/step-5/", 5), "final", "TrainingJobFailed"),
    ],
)
def test_training_job_not_ready_to_serve(job: dict[str, Any] | None, checkpoint: str, reason: str) -> None:
    with pytest.raises(ResolveError) as caught:
        resolve_model(source(fromTrainingJob={"name": "train", "checkpoint": checkpoint}), "chargpt", job)
    assert caught.value.reason == reason


@pytest.mark.parametrize("checkpoint", ["final", "latest"])
def test_a_succeeded_job_is_served_from_its_final_export(checkpoint: str) -> None:
    # The export (full weights + config.json) is the serving layout; sharded training checkpoints are not.
    job = training_job("Succeeded", "s3://ckpt/train/step-900/", 900)
    ref = resolve_model(source(fromTrainingJob={"name": "train", "checkpoint": checkpoint}), "chargpt", job)
    assert (ref.storage_uri, ref.version) == ("s3://ckpt/train/final", "final-step-900")
    assert ref.endpoint == "http://s3:9000"


def test_final_needs_a_checkpoint_store() -> None:
    job = training_job("Running")
    del job["spec"]["checkpoint"]
    with pytest.raises(ResolveError) as caught:
        resolve_model(source(fromTrainingJob={"name": "train", "checkpoint": "final"}), "chargpt", job)
    assert caught.value.reason == "NoCheckpointStore" and not caught.value.transient


def test_annotation_round_trip_and_garbage() -> None:
    ref = resolve_model(source(uri="s3://models/gpt/v1", secretRef={"name": "s"}), "noop")
    assert ModelRef.from_annotation(ref.to_annotation()) == ref
    assert ModelRef.from_annotation(None) is None
    assert ModelRef.from_annotation("{not json") is None
    assert ModelRef.from_annotation('{"storageUri": 3}') is None


def hf_job(phase: str, export_format: str | None = "huggingface") -> dict[str, Any]:
    job = training_job(phase, "s3://ckpt/train/step-30/", 30)
    if export_format is not None:
        job["spec"]["checkpoint"]["exportFormat"] = export_format
    return job


@pytest.mark.parametrize("checkpoint", ["final", "latest"])
def test_runtime_vllm_serves_the_jobs_hugging_face_export(checkpoint: str) -> None:
    spec = source(fromTrainingJob={"name": "train", "checkpoint": checkpoint})
    ref = resolve_model(spec, "noop", hf_job("Succeeded"), runtime="vllm")
    assert (ref.storage_uri, ref.version, ref.endpoint) == ("s3://ckpt/train/final", "final-step-30", "http://s3:9000")
    # A running job's sharded checkpoint is no Hugging Face folder: vllm waits for the export, even with latest.
    with pytest.raises(ResolveError) as caught:
        resolve_model(spec, "noop", hf_job("Running"), runtime="vllm")
    assert caught.value.reason == "WaitingForTrainingJob" and caught.value.transient
    assert "final Hugging Face export" in caught.value.message


@pytest.mark.parametrize("export_format", [None, "loom"])
def test_runtime_vllm_refuses_a_job_without_a_hugging_face_export(export_format: str | None) -> None:
    job = hf_job("Succeeded", export_format)
    with pytest.raises(ResolveError) as caught:
        resolve_model(source(fromTrainingJob={"name": "train"}), "noop", job, runtime="vllm")
    error = caught.value
    assert error.reason == "NoHuggingFaceExport" and not error.transient
    assert "TrainingJob train exports loom" in error.message and "exportFormat: huggingface" in error.message
    # The default runtime serves the same job's loom export as before.
    assert resolve_model(source(fromTrainingJob={"name": "train"}), "chargpt", job).storage_uri == "s3://ckpt/train/final"


def test_runtime_vllm_needs_the_job_and_its_checkpoint_store() -> None:
    with pytest.raises(ResolveError) as missing:
        resolve_model(source(fromTrainingJob={"name": "train"}), "noop", None, runtime="vllm")
    assert missing.value.reason == "TrainingJobNotFound"
    job = hf_job("Succeeded")
    del job["spec"]["checkpoint"]
    with pytest.raises(ResolveError) as storeless:
        resolve_model(source(fromTrainingJob={"name": "train"}), "noop", job, runtime="vllm")
    assert storeless.value.reason == "NoCheckpointStore" and not storeless.value.transient
    with pytest.raises(ResolveError) as failed:
        resolve_model(source(fromTrainingJob={"name": "train"}), "noop", hf_job("Failed"), runtime="vllm")
    assert failed.value.reason == "TrainingJobFailed"
