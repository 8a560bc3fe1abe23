"""The operator's MLflow registry client against a real MLflow server: one job one version (idempotent), aliases
read and moved, version tags (the rejection tag among them)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from loom.devstack.servers import MLflowEndpoint
from loom.operator.core.model import JOB_UID_TAG, REJECTED_TAG
from loom.operator.core.registry import Registry


def new_run(mlflow: MLflowEndpoint) -> str:
    with httpx.Client(base_url=mlflow.url, timeout=30, trust_env=False) as client:
        experiment = client.post("/api/2.0/mlflow/experiments/create",
                                 json={"name": f"registry-{uuid.uuid4().hex[:8]}"}).json()["experiment_id"]
        run = client.post("/api/2.0/mlflow/runs/create", json={"experiment_id": experiment}).json()["run"]
        run_id = run["info"]["run_id"]
        client.post("/api/2.0/mlflow/runs/log-metric",
                    json={"run_id": run_id, "key": "loss", "value": 0.25, "timestamp": 1, "step": 200})
        return str(run_id)


async def test_register_once_alias_and_tags(mlflow: MLflowEndpoint) -> None:
    name = f"chargpt-{uuid.uuid4().hex[:6]}"
    run = new_run(mlflow)
    async with Registry(mlflow.url) as registry:
        assert await registry.by_alias(name, "champion") is None  # no such model yet: None, not an error
        await registry.ensure_model(name)
        await registry.ensure_model(name)  # twice is fine
        assert await registry.find_run_version(name, run, "uid-1") is None
        created = await registry.create_version(name, source="s3://ckpt/chargpt/final", run_id=run,
                                                tags={JOB_UID_TAG: "uid-1", "loom.dev/trainingjob": "ml/chargpt"})
        assert created.version == "1"
        again = await registry.find_run_version(name, run, "uid-1")
        assert again is not None and again.version == "1"  # found again: an operator restart registers nothing new
        assert await registry.find_run_version(name, run, "uid-2") is None  # another job's UID is another job
        assert await registry.run_metrics(run) == {"loss": 0.25}

        second = await registry.create_version(name, source="s3://ckpt/chargpt-2/final", run_id=new_run(mlflow),
                                               tags={})
        await registry.set_alias(name, "champion", created.version)
        found = await registry.by_alias(name, "champion")
        assert found is not None and (found.version, found.source) == ("1", "s3://ckpt/chargpt/final")
        await registry.set_alias(name, "champion", second.version)  # the alias moves
        moved = await registry.by_alias(name, "champion")
        assert moved is not None and moved.version == "2"
        assert await registry.by_alias(name, "nobody") is None

        await registry.set_version_tag(name, "2", REJECTED_TAG, "CheckFailed: errors: canary 0.25 > max 0.02")
        tagged = await registry.find_run_version(name, str(moved.run_id), "x")
        assert tagged is None  # no UID tag on version 2
    with httpx.Client(base_url=mlflow.url, timeout=30, trust_env=False) as client:
        raw = client.get("/api/2.0/mlflow/model-versions/get", params={"name": name, "version": "2"}).json()
    tags = {t["key"]: t["value"] for t in raw["model_version"]["tags"]}
    assert tags[REJECTED_TAG].startswith("CheckFailed")


def job_and_spec(mlflow: MLflowEndpoint, name: str, uid: str, alias: str | None = "challenger") -> tuple[Any, Any, Any]:
    from loom.operator.kinds.trainingjob.api import TrainingJobSpec, TrainingJobStatus

    job = {"metadata": {"name": "chargpt", "namespace": "ml", "uid": uid}}
    spec = TrainingJobSpec.model_validate({
        "engine": "fsdp", "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
        "checkpoint": {"uri": f"s3://ckpt/{uid}"},
        "tracking": {"mlflow": {"trackingUri": mlflow.url}},
        "register": {"model": name, "alias": alias, "tags": {"team": "ml"}} if alias else {"model": name},
    })  # fmt: skip
    status = TrainingJobStatus.model_validate({
        "phase": "Succeeded", "mlflow": {"runId": new_run(mlflow)},
        "checkpoint": {"latest": f"s3://ckpt/{uid}/step-000000200", "step": 200},
    })  # fmt: skip
    return job, spec, status


async def test_a_training_job_registers_once_with_its_tags_and_alias(mlflow: MLflowEndpoint) -> None:
    from loom.operator.kinds.trainingjob.registration.io import register_model
    from loom.operator.kinds.trainingjob.registration.version import needs_registration

    name = f"reg-{uuid.uuid4().hex[:6]}"
    job, spec, status = job_and_spec(mlflow, name, "uid-a")
    assert needs_registration(spec, status)
    registered, events = await register_model(job, spec, status)
    assert (registered.version, registered.alias, registered.source) == ("1", "challenger", "s3://ckpt/uid-a/final")
    assert [e.reason for e in events] == ["ModelRegistered"]
    # The operator restarted before writing status: the same job finds its version, registers nothing new.
    again, _ = await register_model(job, spec, status)
    assert again.version == "1"
    status.registered_model = again
    assert not needs_registration(spec, status)
    with httpx.Client(base_url=mlflow.url, timeout=30, trust_env=False) as client:
        raw = client.get("/api/2.0/mlflow/model-versions/get", params={"name": name, "version": "1"}).json()
        listed = client.get("/api/2.0/mlflow/model-versions/search", params={"filter": f"name = '{name}'"}).json()
        by_alias = client.get("/api/2.0/mlflow/registered-models/alias",
                              params={"name": name, "alias": "challenger"}).json()
    version = raw["model_version"]
    tags = {t["key"]: t["value"] for t in version["tags"]}
    assert len(listed["model_versions"]) == 1
    assert version["run_id"] == status.mlflow.run_id and version["source"] == "s3://ckpt/uid-a/final"
    assert tags["loom.dev/trainingjob"] == "ml/chargpt" and tags["loom.dev/checkpoint"].endswith("step-000000200")
    assert tags["metric.loss"] == "0.25" and tags["team"] == "ml" and tags["loom.dev/step"] == "200"
    assert by_alias["model_version"]["version"] == "1"
    # A second job is a second version, and the alias moves to it.
    job2, spec2, status2 = job_and_spec(mlflow, name, "uid-b")
    second, _ = await register_model(job2, spec2, status2)
    assert second.version == "2"


async def test_alias_following_asks_mlflow_at_most_once_per_interval(mlflow: MLflowEndpoint) -> None:
    from datetime import UTC, datetime, timedelta

    from loom.operator.kinds.inferenceservice.source.alias import change_reason
    from loom.operator.kinds.inferenceservice.source.api import ModelSource
    from loom.operator.kinds.inferenceservice.source.io import resolve_alias
    from loom.operator.kinds.inferenceservice.source.model import resolve_model

    name = f"follow-{uuid.uuid4().hex[:6]}"
    source = ModelSource.model_validate({"mlflow": f"models:/{name}@champion", "trackingUri": mlflow.url})
    t0 = datetime(2026, 11, 26, 3, 0, tzinfo=UTC)
    status, error = await resolve_alias(source, None, t0)
    assert error is not None and error.reason == "AliasNotFound" and status is not None
    async with Registry(mlflow.url) as registry:
        await registry.ensure_model(name)
        for _ in range(2):
            await registry.create_version(name, source="s3://m/x", run_id=new_run(mlflow), tags={})
        await registry.set_alias(name, "champion", "1")
        status, error = await resolve_alias(source, None, t0)
        assert error is None and status is not None and status.version == "1"
        ref = resolve_model(source, "auto", alias_version=status.version)
        assert (ref.storage_uri, ref.version) == (f"models:/{name}/1", "1")
        await registry.set_alias(name, "champion", "2")
        # Within the interval the answer kept in status stands: MLflow is not asked.
        kept, _ = await resolve_alias(source, status, t0 + timedelta(seconds=29))
        assert kept == status
        moved, _ = await resolve_alias(source, status, t0 + timedelta(seconds=30))
        assert moved is not None and (moved.version, moved.previous_version) == ("2", "1")
        assert change_reason(moved) == (f"alias champion of {name} moved from version 1 to 2 at "
                                        "2026-11-26T03:00:30Z")
    # MLflow gone: the version last seen keeps serving, the error is said.
    gone = ModelSource.model_validate({"mlflow": f"models:/{name}@champion", "trackingUri": "http://127.0.0.1:9"})
    kept, error = await resolve_alias(gone, moved, t0 + timedelta(minutes=5))
    assert error is None and kept is not None and kept.version == "2" and "unreachable" in str(kept.error)


async def test_rejection_tag_and_promotion_alias(mlflow: MLflowEndpoint) -> None:
    from loom.operator.kinds.inferenceservice.canary.api import RejectedVersion, RolloutStatus
    from loom.operator.kinds.inferenceservice.source.io import registry_writes
    from loom.operator.kinds.inferenceservice.source.model import ModelRef

    name = f"judge-{uuid.uuid4().hex[:6]}"
    async with Registry(mlflow.url) as registry:
        await registry.ensure_model(name)
        for _ in range(3):
            await registry.create_version(name, source="s3://m/x", run_id=new_run(mlflow), tags={})

    def ref(version: str) -> ModelRef:
        return ModelRef(storage_uri=f"models:/{name}/{version}", storage_kind="mlflow", handler="mlflow-pyfunc",
                        version=version, tracking_uri=mlflow.url)

    promoted = await registry_writes(RolloutStatus(), ref("2"), promote_alias="champion", promoted=True)
    assert promoted.promoted_alias == "champion=2"
    rejected = RolloutStatus(rejected=[RejectedVersion(model_version="3", model_key="k3", reason="CheckFailed",
                                                       message="errors: canary 0.25 > max 0.02")])
    tagged = await registry_writes(rejected, ref("3"), promote_alias="champion", promoted=False)
    assert tagged.rejected[0].tagged
    async with Registry(mlflow.url) as registry:
        champion = await registry.by_alias(name, "champion")
    assert champion is not None and champion.version == "2"  # a rejection never moves the alias
    with httpx.Client(base_url=mlflow.url, timeout=30, trust_env=False) as client:
        raw = client.get("/api/2.0/mlflow/model-versions/get", params={"name": name, "version": "3"}).json()
    tags = {t["key"]: t["value"] for t in raw["model_version"]["tags"]}
    assert tags[REJECTED_TAG] == "CheckFailed: errors: canary 0.25 > max 0.02"


async def test_a_rejected_candidate_of_the_followed_alias_gives_it_back_to_the_serving_version(
    mlflow: MLflowEndpoint,
) -> None:
    """A service following `champion` (its promotion alias) reads a move of it as a candidate: rejected, `champion`
    names the version that serves again; a service following another alias (or a newer move) is left alone."""
    from loom.operator.kinds.inferenceservice.canary.api import RejectedVersion, RolloutStatus
    from loom.operator.kinds.inferenceservice.source.io import registry_writes
    from loom.operator.kinds.inferenceservice.source.model import ModelRef

    name = f"restore-{uuid.uuid4().hex[:6]}"
    async with Registry(mlflow.url) as registry:
        await registry.ensure_model(name)
        for _ in range(4):
            await registry.create_version(name, source="s3://m/x", run_id=new_run(mlflow), tags={})

    def ref(version: str) -> ModelRef:
        return ModelRef(storage_uri=f"models:/{name}/{version}", storage_kind="mlflow", handler="mlflow-pyfunc",
                        version=version, tracking_uri=mlflow.url)

    def rejecting(version: str) -> RolloutStatus:
        return RolloutStatus(rejected=[RejectedVersion(model_version=version, model_key=f"k{version}",
                                                       reason="CheckFailed", message="errors")])

    async def champion() -> str | None:
        async with Registry(mlflow.url) as registry:
            found = await registry.by_alias(name, "champion")
        return found.version if found else None

    async with Registry(mlflow.url) as registry:
        await registry.set_alias(name, "champion", "3")
    # Following challenger while promoting champion: champion is not the candidate's alias, nothing moves.
    done = await registry_writes(rejecting("3"), ref("3"), promote_alias="champion", promoted=False,
                                 followed_alias="challenger", stable=ref("2"))
    assert done.rejected[0].tagged and await champion() == "3"
    # Following champion: it goes back to version 2, which serves.
    done = await registry_writes(rejecting("3"), ref("3"), promote_alias="champion", promoted=False,
                                 followed_alias="champion", stable=ref("2"))
    assert done.rejected[0].tagged and await champion() == "2"
    # Moved on since (to version 4): the newer move stands.
    async with Registry(mlflow.url) as registry:
        await registry.set_alias(name, "champion", "4")
    await registry_writes(rejecting("3"), ref("3"), promote_alias="champion", promoted=False,
                          followed_alias="champion", stable=ref("2"))
    assert await champion() == "4"
