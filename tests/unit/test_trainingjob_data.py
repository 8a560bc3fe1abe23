"""TrainingJob spec.trainingData: the retrieval Job, the workers' env, and how the state machine waits for it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from loom.operator.kinds.featureview.api import FeatureViewSpec
from loom.operator.kinds.featureview.config import Member, plan_project
from loom.operator.kinds.featureview.render import PROJECT_LABEL
from loom.operator.kinds.featureview.status import JobResult
from loom.operator.kinds.trainingjob import render
from loom.operator.kinds.trainingjob.api import TrainingDataStatus, TrainingJobSpec, TrainingJobStatus
from loom.operator.kinds.trainingjob.data.retrieval import (
    DataObservation,
    data_job_name,
    observe_job,
    output_uri,
    plan_refusal,
    render_data_job,
    view_not_ready,
)
from loom.operator.kinds.trainingjob.decision import Decision, Observation
from loom.operator.kinds.trainingjob.state import decide

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
JOB = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "conv", "namespace": "ns", "uid": "u1"},
}
DATA = {
    "featureView": "driver-stats",
    "entityDataframe": "s3://loom-features/driver_entities.parquet",
    "endpoint": "http://minio.storage.svc:9000",
}


def spec(**data: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "engine": "fsdp",
            "entrypoint": {"module": "m:task"},
            "workers": {"replicas": 3},
            "checkpoint": {"uri": "s3://ckpt/conv", "secretRef": {"name": "ckpt-keys"}},
            "trainingData": {**DATA, **data},
        }
    )


def example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


def plan() -> Any:
    view = FeatureViewSpec.model_validate(example("featureview-driver-stats.yaml")["spec"])
    return plan_project("rides", [Member("driver-stats", "fv-uid", "2026-01-01T00:00:00Z", view)])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# ---- API ------------------------------------------------------------------------------------------------


def test_training_data_must_name_s3_parquet_objects() -> None:
    with pytest.raises(ValidationError, match=r"entity_?[dD]ataframe"):
        spec(entityDataframe="/data/entities.parquet")
    with pytest.raises(ValidationError, match="output"):
        spec(output="file:///tmp/x.parquet")


# ---- names and where the set goes ----------------------------------------------------------------------


def test_output_defaults_next_to_the_entity_dataframe_per_namespace_and_job() -> None:
    data = spec().training_data
    assert data is not None
    assert output_uri(data, "team-a", "conv") == "s3://loom-features/loom-training-data/team-a/conv.parquet"
    explicit = spec(output="s3://sets/conv/train.parquet").training_data
    assert explicit is not None and output_uri(explicit, "team-a", "conv") == "s3://sets/conv/train.parquet"


def test_job_name_fits_a_label_value_and_stays_unique() -> None:
    assert data_job_name("conv") == "conv-training-data"
    long_a, long_b = "a" * 54, "a" * 53 + "b"
    assert len(data_job_name(long_a)) <= 63 and len(data_job_name(long_b)) <= 63
    assert data_job_name(long_a) != data_job_name(long_b)


# ---- the retrieval Job ------------------------------------------------------------------------------------


def test_retrieval_job_runs_historical_on_the_views_project_store() -> None:
    job = render_data_job(JOB, spec(), plan(), "loom/features:1")
    assert job["metadata"]["name"] == "conv-training-data"
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u1"
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == [
        "python", "-m", "loom.workloads.features", "historical", "--config", "/etc/loom/features/features.json",
        "--view", "driver_stats",
        "--entities", "s3://loom-features/driver_entities.parquet",
        "--output", "s3://loom-features/loom-training-data/ns/conv.parquet",
        "--s3-endpoint", "http://minio.storage.svc:9000",
    ]  # fmt: skip
    assert container["image"] == "loom/features:1"
    assert container["terminationMessagePolicy"] == "File"
    assert {"name": "config", "configMap": {"name": "rides-features"}} in pod["volumes"]
    assert pod["restartPolicy"] == "Never"
    # A bad view or an unreadable entity dataframe fails the Job at once; only exit 1 is retried.
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2, 3, 4]
    # Not a registry writer of the project (the FeatureView controller serializes those), and the pods trigger
    # the TrainingJob's reconcile like its workers do (same job label, another component).
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert PROJECT_LABEL not in labels and PROJECT_LABEL not in job["metadata"]["labels"]
    assert labels["loom.dev/trainingjob"] == "conv"
    assert labels["app.kubernetes.io/component"] == "training-data"
    # The view's source credentials, by reference.
    assert env_of(container)["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}
    }


def test_training_data_secret_replaces_the_views_keys_once() -> None:
    job = render_data_job(JOB, spec(secretRef={"name": "data-keys"}, fullFeatureNames=True), plan(), "img")
    container = job["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))
    assert env_of(container)["AWS_SECRET_ACCESS_KEY"]["secretKeyRef"]["name"] == "data-keys"
    assert container["command"][-1] == "--full-feature-names"


def test_every_worker_is_told_where_the_training_set_is() -> None:
    pods = [render.worker_pod(JOB, spec(), i, attempt=0, image="t", mlflow_run_id=None) for i in range(3)]
    for pod in pods:
        env = env_of(pod["spec"]["containers"][0])
        assert env["LOOM_TRAINING_DATA"] == "s3://loom-features/loom-training-data/ns/conv.parquet"
        assert env["LOOM_TRAINING_DATA_ENDPOINT"] == "http://minio.storage.svc:9000"
        assert env["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "ckpt-keys"
    own = render.worker_pod(JOB, spec(secretRef={"name": "data-keys"}), 0, attempt=0, image="t", mlflow_run_id=None)
    container = own["spec"]["containers"][0]
    assert env_of(container)["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "data-keys"
    assert len({e["name"] for e in container["env"]}) == len(container["env"])


# ---- observation ------------------------------------------------------------------------------------------


def test_a_missing_or_unregistered_view_is_a_reason_to_wait() -> None:
    data = spec().training_data
    assert data is not None
    missing = view_not_ready(data, None, "s3://o")
    assert missing is not None and (missing.state, missing.reason) == ("Waiting", "FeatureViewNotFound")
    assert "driver-stats" in missing.message
    refused = {"status": {"conditions": [
        {"type": "Registered", "status": "False", "reason": "InvalidSource", "message": "no column event_ts"}
    ]}}  # fmt: skip
    waiting = view_not_ready(data, refused, "s3://o")
    assert waiting is not None and waiting.reason == "FeatureViewNotRegistered"
    assert "InvalidSource: no column event_ts" in waiting.message
    ok = {"status": {"conditions": [{"type": "Registered", "status": "True"}]}}
    assert view_not_ready(data, ok, "s3://o") is None
    assert plan_refusal(data, plan()) is None
    other = spec(featureView="other-view").training_data
    assert other is not None and plan_refusal(other, plan()) is not None


def test_job_outcome_carries_rows_or_feasts_message() -> None:
    done = observe_job(
        JobResult("conv-training-data", "Succeeded", completed="2026-03-01T12:00:00Z",
                  result={"rows": 230, "rowsWithoutFeatures": 5, "output": "s3://o/x.parquet"}),
        "s3://o/x.parquet",
    )  # fmt: skip
    assert done.state == "Succeeded"
    assert (done.status.rows, done.status.rows_without_features, done.status.job) == (230, 5, "conv-training-data")
    failed = observe_job(
        JobResult("j", "Failed", exit_code=3, reason="InvalidSource", message="entity dataframe s3://x: NoSuchKey"),
        "s3://o",
    )
    assert (failed.state, failed.reason) == ("Failed", "InvalidSource")
    assert failed.message == "entity dataframe s3://x: NoSuchKey"
    assert observe_job(JobResult("j", "Running"), "s3://o").state == "Running"


# ---- the state machine --------------------------------------------------------------------------------------


def step(status: TrainingJobStatus | None = None, data: DataObservation | None = None) -> Decision:
    return decide(Observation(generation=1, spec=spec(), status=status or TrainingJobStatus(), pods=(), now=NOW,
                              training_data=data))  # fmt: skip


def cond(decision: Decision, kind: str) -> tuple[str, str, str]:
    c = next(c for c in decision.status.conditions if c.type == kind)
    return c.status, c.reason, c.message


def test_no_worker_starts_while_the_view_is_missing() -> None:
    data = spec().training_data
    assert data is not None
    d = step(data=view_not_ready(data, None, "s3://o"))
    assert d.create == [] and d.status.phase == "Pending"
    assert cond(d, "TrainingDataReady")[:2] == ("False", "FeatureViewNotFound")
    assert cond(d, "Ready")[:2] == ("False", "FeatureViewNotFound")


def test_workers_start_in_the_pass_that_sees_the_set_built_and_it_is_never_rebuilt() -> None:
    built = observe_job(JobResult("conv-training-data", "Succeeded", result={"rows": 10}), "s3://o")
    running = step(data=observe_job(JobResult("conv-training-data", "Running"), "s3://o"))
    assert running.create == [] and cond(running, "TrainingDataReady")[1] == "Retrieving"
    d = step(running.status, built)
    assert d.create == [0, 1, 2]
    assert cond(d, "TrainingDataReady") == ("True", "Retrieved", "10 rows at s3://o")
    assert any(e.reason == "TrainingDataReady" for e in d.events)
    # Later passes (a restart, a resumed job) observe nothing and need nothing: the set stays built.
    later = step(d.status.model_copy(update={"attempt": 1}), None)
    assert later.status.training_data == d.status.training_data
    assert cond(later, "TrainingDataReady")[0] == "True"


def test_failed_retrieval_fails_the_job_with_feasts_message_and_keeps_it() -> None:
    failed = observe_job(JobResult("j", "Failed", reason="InvalidSource", message="NoSuchKey: entities"), "s3://o")
    d = step(data=failed)
    assert d.status.phase == "Failed" and d.create == []
    assert cond(d, "Failed")[:2] == ("True", "TrainingDataFailed")
    assert "NoSuchKey: entities" in cond(d, "Failed")[2]
    assert cond(d, "TrainingDataReady") == ("False", "InvalidSource", "NoSuchKey: entities")
    again = step(d.status, None)
    assert cond(again, "TrainingDataReady") == ("False", "InvalidSource", "NoSuchKey: entities")


def test_jobs_without_training_data_have_no_such_condition() -> None:
    plain = TrainingJobSpec.model_validate({"engine": "fsdp", "entrypoint": {"module": "m:task"}})
    d = decide(Observation(generation=1, spec=plain, status=TrainingJobStatus(), pods=(), now=NOW))
    assert d.create == [0]
    assert all(c.type != "TrainingDataReady" for c in d.status.conditions)
    assert TrainingDataStatus().phase is None
