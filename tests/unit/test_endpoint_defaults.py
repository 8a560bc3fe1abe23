"""Cluster-wide endpoint defaults (operator/defaults.py): filled only into what an object leaves unset, recorded
for status, and a missing MLflow endpoint reported as EndpointNotConfigured naming the chart value."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.devstack.images import IMAGE_ENV
from loom.e2e.example_specs import resolved
from loom.operator import defaults
from loom.operator.defaults import EndpointDefaults
from loom.operator.kinds.featureview.api import FeatureViewSpec
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.rollout import RolloutPlan
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.operator.kinds.inferenceservice.status import Observed, compute_status
from loom.operator.kinds.trainingjob import render
from loom.operator.kinds.trainingjob.api import TrainingJobSpec, TrainingJobStatus
from loom.operator.kinds.trainingjob.decision import Observation, Policy
from loom.operator.kinds.trainingjob.state import decide
from loom.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CHART = REPO / "charts" / "loom"
CLUSTER = EndpointDefaults(
    s3_endpoint="http://minio.storage:9000",
    s3_secret_name="s3-credentials",
    mlflow_tracking_uri="http://mlflow.mlops:5000",
)
JOB: dict[str, Any] = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "gpt", "namespace": "team-a", "uid": "uid-1", "generation": 1},
}
DEFAULTERS: dict[str, Any] = {
    "TrainingJob": (TrainingJobSpec, defaults.training_job),
    "InferenceService": (InferenceServiceSpec, defaults.inference_service),
    "FeatureView": (FeatureViewSpec, defaults.feature_view),
}


def job_spec(**overrides: Any) -> TrainingJobSpec:
    base: dict[str, Any] = {"engine": "fsdp", "entrypoint": {"module": "m:task"}, "checkpoint": {"uri": "s3://ckpt/gpt"}}
    base.update(overrides)
    return TrainingJobSpec.model_validate(base)


def examples() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in DEFAULTERS:
                docs.append((f"{path.name}:{doc['metadata']['name']}", doc))
    return docs


@pytest.mark.parametrize(("where", "doc"), examples(), ids=[w for w, _ in examples()])
def test_without_operator_defaults_every_example_is_rendered_from_its_own_spec(where: str, doc: dict[str, Any]) -> None:
    """No defaults configured (an upgrade that adds none): the very spec goes to rendering, so every child,
    ConfigMaps included, is byte-identical and nothing rolls out."""
    model, apply = DEFAULTERS[doc["kind"]]
    spec = model.model_validate(doc["spec"])
    result = apply(spec, EndpointDefaults())
    assert result.spec is spec and result.used == {} and result.missing == []
    if doc["kind"] == "TrainingJob":  # (a fine-tune renders once its base job resolved: as if it had)
        before = json.dumps(render.config_map(JOB, resolved(spec)), sort_keys=True)
        assert json.dumps(render.config_map(JOB, resolved(result.spec)), sort_keys=True) == before


@pytest.mark.parametrize(("where", "doc"), examples(), ids=[w for w, _ in examples()])
def test_operator_defaults_never_replace_what_an_example_sets(where: str, doc: dict[str, Any]) -> None:
    model, apply = DEFAULTERS[doc["kind"]]
    spec = model.model_validate(doc["spec"])
    result = apply(spec, CLUSTER)
    for path in result.used:
        node: Any = doc
        for part in path.split("."):
            node = (node or {}).get(part) if isinstance(node, dict) else None
        assert node is None, f"{where}: {path} is set by the example yet was defaulted"


def test_a_trainingjob_without_endpoints_gets_the_operator_defaults_in_its_config_and_pods() -> None:
    spec = job_spec(tracking={"mlflow": {"experiment": "gpt"}})
    result = defaults.training_job(spec, CLUSTER)
    assert result.missing == [] and result.problem() is None
    assert result.status_field() == {
        "spec.checkpoint.endpoint": "http://minio.storage:9000",
        "spec.checkpoint.secretRef.name": "s3-credentials",
        "spec.tracking.mlflow.trackingUri": "http://mlflow.mlops:5000",
    }
    config = json.loads(next(iter(render.config_map(JOB, result.spec)["data"].values())))
    assert config["checkpoint"]["endpoint"] == "http://minio.storage:9000"
    assert config["tracking"]["mlflow"]["trackingUri"] == "http://mlflow.mlops:5000"
    pod = render.worker_pod(JOB, result.spec, 0, attempt=0, image="loom/trainer:1", mlflow_run_id="r")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.mlops:5000"
    # The credentials by reference only: the Secret's name, never a value.
    secret = {"name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == secret
    assert spec.tracking is not None and spec.tracking.mlflow is not None and spec.tracking.mlflow.tracking_uri is None


def test_a_trainingjob_keeps_its_own_endpoints_and_tracking_is_never_switched_on_by_a_default() -> None:
    own = job_spec(
        checkpoint={"uri": "s3://ckpt/gpt", "endpoint": "http://own:9000", "secretRef": {"name": "own"}},
        tracking={"mlflow": {"trackingUri": "http://own-mlflow:5000"}},
    )
    assert defaults.training_job(own, CLUSTER).spec is own
    untracked = job_spec()
    assert defaults.training_job(untracked, CLUSTER).spec.tracking is None


def test_missing_tracking_uri_names_the_field_and_the_chart_value() -> None:
    result = defaults.training_job(job_spec(tracking={"mlflow": {}}), EndpointDefaults(s3_endpoint="http://s3:9000"))
    assert [(m.path, m.value) for m in result.missing] == [
        ("spec.tracking.mlflow.trackingUri", "defaults.mlflow.trackingUri")
    ]
    assert result.problem() == (
        "spec.tracking.mlflow.trackingUri is not set and the operator has no default: set it, or the chart value "
        "defaults.mlflow.trackingUri"
    )
    assert result.used == {"spec.checkpoint.endpoint": "http://s3:9000"}


def test_missing_endpoint_holds_the_job_pending_with_endpoint_not_configured() -> None:
    problem = "spec.tracking.mlflow.trackingUri is not set and the operator has no default"
    decision = decide(
        Observation(
            generation=1,
            spec=job_spec(tracking={"mlflow": {}}),
            status=TrainingJobStatus(),
            pods=(),
            now=datetime(2026, 1, 1, tzinfo=UTC),
            endpoint_problem=problem,
        ),
        Policy(),
    )
    assert decision.create == []
    assert decision.status.phase == "Pending"
    ready = next(c for c in decision.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason, ready.message) == ("False", "EndpointNotConfigured", problem)


def test_inferenceservice_sources() -> None:
    s3 = InferenceServiceSpec.model_validate({"model": {"uri": "s3://models/gpt"}})
    result = defaults.inference_service(s3, CLUSTER)
    assert result.spec.model.endpoint == "http://minio.storage:9000"
    assert result.spec.model.secret_ref is not None and result.spec.model.secret_ref.name == "s3-credentials"
    assert result.spec.model.tracking_uri is None  # an s3:// source needs no tracking server
    registry = InferenceServiceSpec.model_validate({"model": {"mlflow": "models:/gpt/3"}})
    assert defaults.inference_service(registry, CLUSTER).used["spec.model.trackingUri"] == "http://mlflow.mlops:5000"
    missing = defaults.inference_service(registry, EndpointDefaults())
    assert [m.path for m in missing.missing] == ["spec.model.trackingUri"]
    # A TrainingJob's checkpoints come with the job's (defaulted) endpoint: nothing to add here.
    from_job = InferenceServiceSpec.model_validate({"model": {"fromTrainingJob": {"name": "gpt"}}})
    assert defaults.inference_service(from_job, CLUSTER).spec is from_job


def test_featureview_s3_locations_only() -> None:
    base: dict[str, Any] = {
        "project": "drivers",
        "entities": [{"name": "driver"}],
        "features": [{"name": "rate", "dtype": "Float32"}],
    }
    local = FeatureViewSpec.model_validate({**base, "source": {"path": "/data/stats.parquet"}})
    assert defaults.feature_view(local, CLUSTER).spec is local  # a path on the volume needs no S3
    remote = FeatureViewSpec.model_validate(
        {
            **base,
            "source": {"path": "s3://feat/stats.parquet", "endpoint": "http://own:9000"},
            "store": {"registry": {"path": "s3://feat/registry.db"}},
        }
    )
    result = defaults.feature_view(remote, CLUSTER)
    assert result.spec.source.endpoint == "http://own:9000"
    assert result.spec.source.secret_ref is not None and result.spec.source.secret_ref.name == "s3-credentials"
    assert result.spec.store.registry.endpoint == "http://minio.storage:9000"
    assert set(result.used) == {
        "spec.source.secretRef.name",
        "spec.store.registry.endpoint",
        "spec.store.registry.secretRef.name",
    }


def test_settings_and_chart_values() -> None:
    settings = OperatorSettings.from_env(
        {
            **IMAGE_ENV,
            "LOOM_DEFAULT_S3_ENDPOINT": "http://minio.storage:9000",
            "LOOM_DEFAULT_S3_SECRET_NAME": "s3-credentials",
            "LOOM_DEFAULT_MLFLOW_TRACKING_URI": "http://mlflow.mlops:5000",
        }
    )
    assert EndpointDefaults.from_settings(settings) == CLUSTER
    assert EndpointDefaults.from_settings(OperatorSettings.from_env(IMAGE_ENV)) == EndpointDefaults()
    for bad in ({"LOOM_DEFAULT_S3_ENDPOINT": "minio:9000"}, {"LOOM_DEFAULT_S3_SECRET_NAME": "Not_A_Name"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            OperatorSettings.from_env({**IMAGE_ENV, **bad})
    validator = jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["image"]["registry"] = "registry.example.com/loom"  # the defaults name no image
    assert list(validator.iter_errors(values)) == []
    maximal = {**values, **yaml.safe_load((CHART / "ci" / "max-values.yaml").read_text())}
    assert list(validator.iter_errors(maximal)) == []
    assert all(maximal["defaults"][group][key] for group in ("s3", "mlflow") for key in maximal["defaults"][group])
    for bad in (
        {"defaults": {"s3": {"endpoint": "minio:9000"}}},
        {"defaults": {"mlflow": {"trackingUri": "mlflow"}}},
        {"defaults": {"s3": {"secretName": "Bad_Name"}}},
        {"defaults": {"s3": {"region": "x"}}},
        {"activator": {"maxHeld": 0}},
        {"settings": {"default_s3_endpoint": "http://x"}},  # the chart sets it from defaults.s3.endpoint
    ):
        assert list(validator.iter_errors({**values, **bad})), bad
    template = (CHART / "templates" / "deployment.yaml").read_text()
    assert "{{- with .Values.defaults.mlflow.trackingUri }}" in template  # unset: no variable, no default


def test_an_inferenceservice_serving_a_trainingjob_reads_its_checkpoints_where_the_job_wrote_them() -> None:
    job = {"metadata": {"name": "gpt"}, "spec": {"checkpoint": {"uri": "s3://ckpt/gpt"}}, "status": {}}
    filled = defaults.training_job_manifest(job, CLUSTER)
    assert filled["spec"]["checkpoint"] == {
        "uri": "s3://ckpt/gpt",
        "endpoint": "http://minio.storage:9000",
        "secretRef": {"name": "s3-credentials"},
    }
    assert job["spec"]["checkpoint"] == {"uri": "s3://ckpt/gpt"}  # a copy
    own = {"spec": {"checkpoint": {"uri": "s3://ckpt/gpt", "endpoint": "http://own:9000", "secretRef": {"name": "o"}}}}
    assert defaults.training_job_manifest(own, CLUSTER) is own
    assert defaults.training_job_manifest(job, EndpointDefaults()) is job
    source = InferenceServiceSpec.model_validate({"model": {"fromTrainingJob": {"name": "gpt"}}}).model
    done = {**filled, "status": {"phase": "Succeeded", "checkpoint": {"step": 5}}}
    ref = resolve_model(source, "auto", done)
    assert ref.endpoint == "http://minio.storage:9000" and ref.secret_ref is not None
    assert ref.secret_ref.name == "s3-credentials"


def test_an_inferenceservice_without_its_tracking_server_waits_with_endpoint_not_configured() -> None:
    registry = InferenceServiceSpec.model_validate({"model": {"mlflow": "models:/gpt/3"}})
    assert defaults.model_problem(defaults.inference_service(registry, CLUSTER)) is None
    missing = defaults.model_problem(defaults.inference_service(registry, EndpointDefaults()))
    assert missing is not None
    observed = Observed(
        plan=RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting"),
        stable=None,
        canary=None,
        pods=[],
        serving_config_hash=None,
        resolve_error=missing,
    )
    meta = {"name": "gpt", "namespace": "ml", "uid": "u", "generation": 1}
    owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "metadata": meta}
    status, _ = compute_status(owner, observed, None)
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "EndpointNotConfigured")
    assert "spec.model.trackingUri" in ready.message and "defaults.mlflow.trackingUri" in ready.message
    assert status.phase == "Pending"  # the operator's configuration can fix it: not Failed
