"""FeatureView rendering: the project's FeaturesConfig, the Feast pods' Jobs, CronJob, server and Service."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import ValidationError

from loom.operator.kinds.featureview.api import EntityDtype, FeatureDtype, FeatureViewSpec
from loom.operator.kinds.featureview.config import (
    Member,
    apply_hash,
    apply_job_name,
    cronjob_name,
    feast_view_name,
    manual_job_name,
    plan_project,
    view_config,
)
from loom.operator.kinds.featureview.render import (
    CONFIG_HASH_ANNOTATION,
    PERMANENT_EXIT_CODES,
    cron_expression,
    registered_views,
    render_apply_job,
    render_config_map,
    render_cronjob,
    render_delete_job,
    render_deployment,
    render_manual_job,
    render_service,
)
from loom.workloads.features.config import ENTITY_DTYPES, FEATURE_DTYPES, FeaturesConfig

NS = "team-a"
IMAGE = "loom/features:test"
REPO = Path(__file__).resolve().parents[2]


def spec(**overrides: Any) -> FeatureViewSpec:
    base: dict[str, Any] = {
        "project": "rides",
        "entities": [{"name": "driver_id", "valueType": "Int64"}],
        "features": [{"name": "conv_rate", "dtype": "Float32"}, {"name": "trips", "dtype": "Int64"}],
        "source": {"path": "s3://b/driver_stats.parquet", "endpoint": "http://s3:9000", "secretRef": {"name": "s3"}},
        "ttl": "1d12h",
    }
    base.update(overrides)
    return FeatureViewSpec.model_validate(base)


def member(name: str, created: str = "2026-01-01T00:00:00Z", **overrides: Any) -> Member:
    return Member(name=name, uid=f"uid-{name}", created=created, spec=spec(**overrides))


def test_api_dtypes_are_the_workloads() -> None:
    assert get_args(FeatureDtype) == FEATURE_DTYPES
    assert get_args(EntityDtype) == ENTITY_DTYPES


def test_every_dtype_converts_to_the_workload_config() -> None:
    features = [{"name": f"f{i}", "dtype": d} for i, d in enumerate(FEATURE_DTYPES)]
    for entity_type in ENTITY_DTYPES:
        config = view_config("my-view", spec(features=features, entities=[{"name": "k", "valueType": entity_type}]))
        assert [f.dtype for f in config.features] == list(FEATURE_DTYPES)
        assert config.entities[0].value_type == entity_type


@pytest.mark.parametrize(
    "bad",
    [
        {"features": [{"name": "x", "dtype": "Float16"}]},
        {"entities": [{"name": "k", "valueType": "Float32"}]},
        {"entities": [{"name": "k", "joinKeys": ["a", "b"]}]},
        {"project": "Rides"},
        {"ttl": "1h1d"},
        {"source": {"path": "relative/file.parquet"}},
    ],
)
def test_admission_refuses_what_feast_cannot_take(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        spec(**bad)


def test_view_config_by_keyword() -> None:
    s = spec(
        description="d",
        owner="me@x",
        tags={"team": "rides"},
        entities=[{"name": "driver", "joinKeys": ["driver_id"], "valueType": "String", "tags": {"pii": "no"}}],
        source={"path": "/data/x.parquet", "timestampField": "ts", "createdTimestampField": "created"},
        online=False,
    )
    config = view_config("driver-stats.v2", s)
    assert config.name == "driver_stats_v2"
    assert config.ttl_seconds == 36 * 3600
    assert (config.description, config.owner, config.tags, config.online) == ("d", "me@x", {"team": "rides"}, False)
    assert config.entities[0].join_key == "driver_id" and config.entities[0].tags == {"pii": "no"}
    assert (config.source.timestamp_field, config.source.created_timestamp_field) == ("ts", "created")
    assert feast_view_name("9lives") == "v_9lives"


def test_project_config_defaults_to_files_on_the_shared_folder() -> None:
    plan = plan_project("my-rides", [member("a"), member("b", features=[{"name": "acc", "dtype": "Float64"}])])
    config = FeaturesConfig.model_validate_json(plan.config.to_json())
    assert config.project == "my_rides"
    assert [v.name for v in config.feature_views] == ["a", "b"]
    assert config.registry.path == "/var/lib/loom/features/registry.db"
    assert (config.online_store.type, config.online_store.path) == ("sqlite", "/var/lib/loom/features/online.db")
    assert (config.serve.port, config.serve.metrics_port) == (6566, 8000)
    assert plan.credentials is not None and plan.credentials.name == "s3"


def test_s3_registry_and_redis_store() -> None:
    store = {
        "registry": {"path": "s3://reg/rides/registry.db", "endpoint": "http://s3:9000", "secretRef": {"name": "s3"}},
        "online": {
            "type": "redis",
            "connectionSecretRef": {"name": "redis-conn-secret", "key": "url"},
            "keyTtlSeconds": 600,
        },
    }
    plan = plan_project("rides", [member("a", store=store)])
    yaml_doc = plan.config.feature_store_yaml()
    assert yaml_doc["registry"]["path"] == "s3://reg/rides/registry.db"
    assert yaml_doc["online_store"] == {
        "type": "redis",
        "connection_string": "${LOOM_FEAST_REDIS}",
        "key_ttl_seconds": 600,
    }
    env = {e["name"]: e for e in render_deployment(NS, plan, IMAGE)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LOOM_FEAST_REDIS"]["valueFrom"] == {"secretKeyRef": {"name": "redis-conn-secret", "key": "url"}}
    assert env["FEAST_S3_ENDPOINT_URL"]["value"] == "http://s3:9000"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    # Secrets are referenced by environment variable only, never named in the ConfigMap.
    assert "redis-conn-secret" not in json.dumps(render_config_map(NS, plan, ["a"]))


def test_a_view_with_another_store_or_a_clashing_entity_is_left_out_alone() -> None:
    other_store = {"online": {"type": "redis", "connectionSecretRef": {"name": "r", "key": "k"}}}
    plan = plan_project(
        "rides",
        [
            member("first", "2026-01-01T00:00:00Z"),
            member("second", "2026-01-02T00:00:00Z", store=other_store),
            member("third", "2026-01-03T00:00:00Z", entities=[{"name": "driver_id", "valueType": "String"}]),
            member("fourth", "2026-01-04T00:00:00Z", source={"path": "s3://b/x", "secretRef": {"name": "other"}}),
            member("fifth", "2026-01-05T00:00:00Z", features=[{"name": "acc", "dtype": "Float64"}]),
        ],
    )
    assert [m.name for m in plan.members] == ["first", "fifth"]
    assert plan.rejected["second"].reason == "StoreConflict"
    assert plan.rejected["third"].reason == "InvalidConfig"
    assert "driver_id" in plan.rejected["third"].message
    assert plan.rejected["fourth"].reason == "CredentialsConflict"


def test_project_children_are_owned_by_every_member() -> None:
    plan = plan_project("rides", [member("a"), member("b", features=[{"name": "acc", "dtype": "Float64"}])])
    for obj in (
        render_config_map(NS, plan, ["a", "b", "gone"]),
        render_service(NS, plan),
        render_deployment(NS, plan, IMAGE),
    ):
        assert obj["metadata"]["name"] == "rides-features"
        refs = obj["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == ["uid-a", "uid-b"]
        assert not any(r["controller"] for r in refs)
    assert registered_views(render_config_map(NS, plan, ["b", "a", "gone"])) == ["a", "b", "gone"]
    assert registered_views(None) == []


def test_apply_job_fails_at_once_on_permanent_exit_codes() -> None:
    plan = plan_project("rides", [member("driver-stats")])
    job = render_apply_job(NS, plan, "driver-stats", IMAGE)
    assert job["metadata"]["name"] == apply_job_name("driver-stats", apply_hash(plan, "driver-stats"))
    assert job["metadata"]["ownerReferences"][0]["controller"] is True
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "feast", "operator": "In", "values": list(PERMANENT_EXIT_CODES)},
    }
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    assert container["command"][-4:] == ["--config", "/etc/loom/features/features.json", "--view", "driver_stats"][-4:]
    assert container["command"][3] == "apply"
    assert container["terminationMessagePolicy"] == "File"
    data = next(v for v in pod["volumes"] if v["name"] == "data")
    assert data["hostPath"] == {"path": "/var/lib/loom/features/team-a/rides", "type": "DirectoryOrCreate"}


def test_apply_content_hash_follows_the_view_and_store_only() -> None:
    a, b = member("a"), member("b", features=[{"name": "acc", "dtype": "Float64"}])
    before = apply_hash(plan_project("rides", [a, b]), "a")
    changed_b = member("b", features=[{"name": "acc", "dtype": "Float32"}])
    assert apply_hash(plan_project("rides", [a, changed_b]), "a") == before
    assert apply_hash(plan_project("rides", [member("a", ttl="2h"), b]), "a") != before
    moved = member("a", store={"registry": {"path": "/var/lib/loom/features/other.db"}})
    assert apply_hash(plan_project("rides", [moved]), "a") != before


def test_cronjob_and_manual_run() -> None:
    plan = plan_project("rides", [member("v", materialization={"schedule": "@hourly", "suspend": True})])
    cron = render_cronjob(NS, plan, "v", IMAGE)
    assert cron["metadata"]["name"] == cronjob_name("v")
    assert len(cronjob_name("x" * 253)) <= 52
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert cron["spec"]["suspend"] is True
    assert cron["spec"]["timeZone"] == "Etc/UTC"
    template = cron["spec"]["jobTemplate"]
    assert template["spec"]["template"]["spec"]["containers"][0]["command"][3] == "materialize"
    manual = render_manual_job(NS, plan, "v", "token-1", IMAGE)
    assert manual["metadata"]["name"] == manual_job_name("v", "token-1") != manual_job_name("v", "token-2")
    assert manual["spec"] == template["spec"]
    assert manual["metadata"]["labels"] == template["metadata"]["labels"]
    assert cron_expression("@hourly") == "0 * * * *"


def test_schedule_must_be_cron() -> None:
    schema = json.dumps(yaml.safe_load((REPO / "crds" / "loom.dev_featureviews.yaml").read_text()))
    assert "startsWith('@every')" in schema


def test_delete_job_targets_a_view_gone_from_the_config() -> None:
    plan = plan_project("rides", [member("a")])
    job = render_delete_job(NS, plan, "gone-view", IMAGE)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[3] == "delete" and command[-1] == "gone_view"
    assert job["spec"]["ttlSecondsAfterFinished"] == 3600
    assert [r["uid"] for r in job["metadata"]["ownerReferences"]] == ["uid-a"]


def test_server_rolls_on_a_config_change_and_probes_health() -> None:
    plan = plan_project("rides", [member("a")])
    deployment = render_deployment(NS, plan, IMAGE)
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"][3] == "serve"
    assert {p["containerPort"] for p in container["ports"]} == {6566, 8000}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300
    changed = render_deployment(NS, plan_project("rides", [member("a", ttl="2h")]), IMAGE)
    assert (
        changed["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        != (pod["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])
    )
    service = render_service(NS, plan)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0] == {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}


def test_chart_grants_the_batch_resources() -> None:
    text = (REPO / "charts/loom/templates/rbac.yaml").read_text()
    lines = [line for line in text.splitlines() if not re.fullmatch(r"\s*\{\{-?.*-?\}\}\s*", line)]
    docs = list(yaml.safe_load_all(re.sub(r"\{\{-?.*?-?\}\}", "X", "\n".join(lines))))
    rules = [r for d in docs if d and d.get("kind") == "ClusterRole" for r in d.get("rules", [])]
    granted = {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}
    for verb in ("list", "watch", "create", "delete"):
        assert ("batch", "jobs", verb) in granted
    for verb in ("create", "patch", "delete"):
        assert ("batch", "cronjobs", verb) in granted
    assert ("", "configmaps", "get") in granted


def test_the_example_renders() -> None:
    doc = yaml.safe_load((REPO / "examples" / "featureview-driver-stats.yaml").read_text())
    plan = plan_project(
        doc["spec"]["project"], [Member("driver-stats", "u", "", FeatureViewSpec.model_validate(doc["spec"]))]
    )
    assert not plan.rejected
    assert plan.config.view("driver_stats").source.created_timestamp_field == "created"
