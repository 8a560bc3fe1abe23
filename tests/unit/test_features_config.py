"""The Feast workload's contract (no Feast needed): validation, the feature_store.yaml it renders, no secrets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from loom.workloads.features.config import (
    ENTITY_DTYPES,
    FEATURE_DTYPES,
    FeaturesConfig,
    UnsupportedDtype,
    check_dtype,
    parse_duration,
    project_name,
)


def view(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "driver_stats",
        "entities": [{"name": "driver", "joinKeys": ["driver_id"]}],
        "features": [{"name": "conv_rate", "dtype": "Float32"}],
        "source": {"path": "/data/driver_stats.parquet"},
    }
    document.update(overrides)
    return document


def config(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"project": "demo", "registry": {"path": "/var/lib/feast/registry.db"},
                                "featureViews": [view()]}
    document.update(overrides)
    return document


def test_defaults_and_camel_case_round_trip(tmp_path: Path) -> None:
    parsed = FeaturesConfig.model_validate(config())
    assert parsed.online_store.type == "sqlite"
    assert parsed.serve.port == 6566
    only = parsed.feature_views[0]
    assert only.ttl_seconds == 86400 and only.online is True
    assert only.source.timestamp_field == "event_timestamp"
    assert only.entities[0].join_key == "driver_id"
    path = tmp_path / "features.json"
    path.write_text(parsed.to_json())
    assert "featureViews" in json.loads(path.read_text())
    assert FeaturesConfig.from_file(path) == parsed


def test_entity_join_key_defaults_to_its_name_and_composite_keys_are_refused() -> None:
    parsed = FeaturesConfig.model_validate(config(featureViews=[view(entities=[{"name": "driver_id"}])]))
    assert parsed.feature_views[0].entities[0].join_key == "driver_id"
    with pytest.raises(ValidationError, match="exactly one join key"):
        FeaturesConfig.model_validate(
            config(featureViews=[view(entities=[{"name": "trip", "joinKeys": ["a", "b"]}])])
        )


@pytest.mark.parametrize("dtype", FEATURE_DTYPES)
def test_every_supported_feature_dtype_is_accepted(dtype: str) -> None:
    parsed = FeaturesConfig.model_validate(config(featureViews=[view(features=[{"name": "f", "dtype": dtype}])]))
    assert parsed.feature_views[0].features[0].dtype == dtype


def test_unknown_dtype_names_the_view_and_the_feature() -> None:
    with pytest.raises(ValidationError) as error:
        FeaturesConfig.model_validate(
            config(featureViews=[view(features=[{"name": "trips", "dtype": "Float16"}])])
        )
    assert "feature view 'driver_stats' feature 'trips': unknown dtype 'Float16'" in str(error.value)
    with pytest.raises(UnsupportedDtype, match="entity 'driver': unknown dtype 'Float32'"):
        check_dtype("Float32", "entity 'driver'", ENTITY_DTYPES)


def test_entity_value_types_are_the_ones_feast_can_key_on() -> None:
    with pytest.raises(ValidationError, match="entity 'driver': unknown dtype 'Float64'"):
        FeaturesConfig.model_validate(
            config(featureViews=[view(entities=[{"name": "driver", "valueType": "Float64"}])])
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"features": [{"name": "driver_id", "dtype": "Int64"}]}, "columns declared twice: driver_id"),
        ({"features": [{"name": "event_timestamp", "dtype": "UnixTimestamp"}]}, "timestamp column"),
        ({"source": {"path": "data/x.parquet"}}, "must be absolute or an s3:// URI"),
        ({"ttlSeconds": -1}, "greater than or equal to 0"),
        ({"name": "driver-stats"}, "letters, digits and '_'"),
    ],
)
def test_invalid_views_are_refused_with_the_reason(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FeaturesConfig.model_validate(config(featureViews=[view(**overrides)]))


def test_views_of_a_project_must_agree_on_shared_entities() -> None:
    other = view(name="driver_trips", entities=[{"name": "driver", "joinKeys": ["driver_id"], "valueType": "String"}])
    with pytest.raises(ValidationError, match="entity 'driver' is declared with different"):
        FeaturesConfig.model_validate(config(featureViews=[view(), other]))
    with pytest.raises(ValidationError, match="declared twice: driver_stats"):
        FeaturesConfig.model_validate(config(featureViews=[view(), view()]))


def test_feature_store_yaml_for_the_single_node_default() -> None:
    parsed = FeaturesConfig.model_validate(config(onlineStore={"path": "/data/online.db"}))
    assert parsed.feature_store_yaml() == {
        "project": "demo",
        "provider": "local",
        "registry": {"registry_type": "file", "path": "/var/lib/feast/registry.db", "cache_ttl_seconds": 60},
        "online_store": {"type": "sqlite", "path": "/data/online.db"},
        "offline_store": {"type": "file"},
        "entity_key_serialization_version": 3,
    }
    assert parsed.registry.location == "/var/lib/feast/registry.db"
    assert parsed.s3_endpoints() == {}


def test_scalable_store_renders_secret_references_never_secrets() -> None:
    parsed = FeaturesConfig.model_validate(config(
        registry={"type": "sql", "urlEnv": "FEAST_REGISTRY_URL", "cacheTtlSeconds": 10},
        onlineStore={"type": "redis", "connectionStringEnv": "REDIS_CONN", "keyTtlSeconds": 3600},
    ))
    rendered = parsed.feature_store_yaml()
    assert rendered["registry"] == {"registry_type": "sql", "path": "${FEAST_REGISTRY_URL}", "cache_ttl_seconds": 10}
    assert rendered["online_store"] == {"type": "redis", "connection_string": "${REDIS_CONN}", "key_ttl_seconds": 3600}
    assert parsed.registry.location == "sql (${FEAST_REGISTRY_URL})"


def test_s3_registry_endpoint_becomes_feast_s3_endpoint_variable() -> None:
    parsed = FeaturesConfig.model_validate(
        config(registry={"path": "s3://feast/registry.db", "endpoint": "http://s3.loom-system:9000"})
    )
    assert parsed.feature_store_yaml()["registry"]["path"] == "s3://feast/registry.db"
    assert parsed.s3_endpoints() == {"FEAST_S3_ENDPOINT_URL": "http://s3.loom-system:9000"}


@pytest.mark.parametrize(
    ("registry", "message"),
    [
        ({"type": "file"}, "needs a path"),
        ({"path": "registry.db"}, "must be absolute"),
        ({"type": "sql"}, "needs urlEnv"),
        ({"type": "sql", "urlEnv": "URL", "path": "postgresql://u:p@db/feast"}, "not path"),
    ],
)
def test_registry_settings_are_checked(registry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FeaturesConfig.model_validate(config(registry=registry))


def test_project_names() -> None:
    assert project_name("team-a.features") == "team_a_features"
    with pytest.raises(ValidationError, match="Feast project"):
        FeaturesConfig.model_validate(config(project="team-a"))


@pytest.mark.parametrize(("text", "seconds"), [("86400s", 86400), ("90m", 5400), ("24h", 86400), ("1d12h", 129600)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


def test_bad_duration_is_refused() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("1 day")


def test_the_contract_imports_without_feast() -> None:
    """The operator imports config.py; pulling Feast (and pandas, dask) into it would bloat its image."""
    import subprocess
    import sys

    probe = ("import sys, loom.workloads.features.config; "
             "print(sorted({'feast', 'pandas', 'pyarrow'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={"PYTHONSAFEPATH": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
