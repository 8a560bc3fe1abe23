"""Contract -> Feast SDK objects (pure, real Feast classes): every supported dtype, entities, source, view."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from feast import FeatureView, FileSource, ValueType
from feast import types as ft

from loom.workloads.features.config import ARRAY_DTYPES, FEATURE_DTYPES, SCALAR_DTYPES, FeaturesConfig, UnsupportedDtype
from loom.workloads.features.convert import (
    MANAGED_BY_TAG,
    MissingEnvironment,
    entity_value_type,
    expand_env,
    feast_dtype,
    repo_config,
    to_feast_objects,
)

EXPECTED_SCALARS = {
    "Int32": ft.Int32, "Int64": ft.Int64, "Float32": ft.Float32, "Float64": ft.Float64,
    "String": ft.String, "Bool": ft.Bool, "Bytes": ft.Bytes, "UnixTimestamp": ft.UnixTimestamp,
}
EXPECTED_VALUE_TYPES = {
    "Int32": ValueType.INT32_LIST, "Int64": ValueType.INT64_LIST, "Float32": ValueType.FLOAT_LIST,
    "Float64": ValueType.DOUBLE_LIST, "String": ValueType.STRING_LIST, "Bool": ValueType.BOOL_LIST,
    "Bytes": ValueType.BYTES_LIST, "UnixTimestamp": ValueType.UNIX_TIMESTAMP_LIST,
}


def make_config(**view_overrides: Any) -> FeaturesConfig:
    view: dict[str, Any] = {
        "name": "driver_stats",
        "entities": [{"name": "driver", "joinKeys": ["driver_id"], "description": "a driver", "tags": {"pii": "no"}}],
        "features": [{"name": "conv_rate", "dtype": "Float32", "description": "conversion", "tags": {"unit": "1"}}],
        "source": {"path": "/data/driver_stats.parquet", "createdTimestampField": "created"},
        "ttlSeconds": 7200,
        "online": False,
        "description": "hourly driver statistics",
        "owner": "team-a@example.com",
        "tags": {"team": "a"},
    }
    view.update(view_overrides)
    return FeaturesConfig.model_validate({"project": "demo", "registry": {"path": "/r/registry.db"},
                                          "featureViews": [view]})


def test_supported_dtypes_are_the_scalars_and_their_arrays() -> None:
    assert set(SCALAR_DTYPES) == set(EXPECTED_SCALARS)
    assert len(FEATURE_DTYPES) == 16


@pytest.mark.parametrize("dtype", SCALAR_DTYPES)
def test_scalar_dtype_maps_to_the_feast_type(dtype: str) -> None:
    assert feast_dtype(dtype, "feature 'f'") == EXPECTED_SCALARS[dtype]


@pytest.mark.parametrize("dtype", ARRAY_DTYPES)
def test_array_dtype_maps_to_a_feast_array(dtype: str) -> None:
    converted = feast_dtype(dtype, "feature 'f'")
    assert isinstance(converted, ft.Array)
    scalar = dtype.removeprefix("Array(").removesuffix(")")
    assert converted.base_type == EXPECTED_SCALARS[scalar]
    assert converted.to_value_type() == EXPECTED_VALUE_TYPES[scalar]


@pytest.mark.parametrize("dtype", ["Float16", "Array(Array(Int64))", "Map", "int64", ""])
def test_unknown_dtype_error_names_the_field(dtype: str) -> None:
    with pytest.raises(UnsupportedDtype, match=r"feature view 'v' feature 'trips': unknown dtype"):
        feast_dtype(dtype, "feature view 'v' feature 'trips'")


@pytest.mark.parametrize(
    ("dtype", "value_type"),
    [("Int32", ValueType.INT32), ("Int64", ValueType.INT64), ("String", ValueType.STRING),
     ("Bytes", ValueType.BYTES), ("UnixTimestamp", ValueType.UNIX_TIMESTAMP)],
)
def test_entity_value_types(dtype: str, value_type: ValueType) -> None:
    assert entity_value_type(dtype, "entity 'e'") == value_type


def test_view_with_every_dtype_has_that_schema() -> None:
    features = [{"name": f"f{i}", "dtype": dtype} for i, dtype in enumerate(FEATURE_DTYPES)]
    _, feature_view = to_feast_objects(make_config(features=features).feature_views[0])
    by_name = {field.name: field.dtype for field in feature_view.features}
    assert [field.name for field in feature_view.features] == [f["name"] for f in features]
    for feature in features:
        assert by_name[feature["name"]] == feast_dtype(feature["dtype"], "f")


def test_entities_source_and_view_carry_everything_the_resource_says() -> None:
    entities, feature_view = to_feast_objects(make_config().feature_views[0])
    [entity] = entities
    assert (entity.name, entity.join_key, entity.value_type) == ("driver", "driver_id", ValueType.INT64)
    assert entity.description == "a driver"
    assert entity.tags == {"pii": "no", **MANAGED_BY_TAG}

    assert isinstance(feature_view, FeatureView)
    assert feature_view.name == "driver_stats"
    assert feature_view.ttl == timedelta(hours=2)
    assert feature_view.online is False
    assert feature_view.description == "hourly driver statistics"
    assert feature_view.owner == "team-a@example.com"
    assert feature_view.tags == {"team": "a", **MANAGED_BY_TAG}
    assert feature_view.entities == ["driver"]
    assert [(c.name, c.dtype) for c in feature_view.entity_columns] == [("driver_id", ft.Int64)]
    [feature] = feature_view.features
    assert (feature.name, feature.dtype, feature.description, feature.tags) == (
        "conv_rate", ft.Float32, "conversion", {"unit": "1"}
    )

    source = feature_view.batch_source
    assert isinstance(source, FileSource)
    assert source.path == "/data/driver_stats.parquet"
    assert source.timestamp_field == "event_timestamp"
    assert source.created_timestamp_column == "created"
    assert source.s3_endpoint_override in ("", None)


def test_s3_source_keeps_its_endpoint_and_ttl_zero_means_forever() -> None:
    config = make_config(
        source={"path": "s3://features/driver_stats.parquet", "endpoint": "http://s3:9000"}, ttlSeconds=0
    )
    _, feature_view = to_feast_objects(config.feature_views[0])
    assert feature_view.batch_source.path == "s3://features/driver_stats.parquet"
    assert feature_view.batch_source.s3_endpoint_override == "http://s3:9000"
    assert feature_view.batch_source.created_timestamp_column == ""
    assert feature_view.ttl == timedelta(0)


def test_conversion_is_deterministic_so_apply_can_diff() -> None:
    first = to_feast_objects(make_config().feature_views[0])[1]
    second = to_feast_objects(make_config().feature_views[0])[1]
    assert first == second
    assert first != to_feast_objects(make_config(ttlSeconds=60).feature_views[0])[1]


def test_repo_config_for_the_default_store() -> None:
    config = make_config()
    built = repo_config(config, environ={})
    assert built.project == "demo"
    assert built.online_config == {"type": "sqlite", "path": "/var/lib/loom/features/online.db"}
    assert built.registry_config["path"] == "/r/registry.db"
    assert built.offline_config == {"type": "file"}
    assert built.entity_key_serialization_version == 3


def test_repo_config_fills_secret_references_from_the_environment() -> None:
    config = FeaturesConfig.model_validate({
        "project": "demo",
        "registry": {"type": "sql", "urlEnv": "REGISTRY_URL"},
        "onlineStore": {"type": "redis", "connectionStringEnv": "REDIS_CONN"},
    })
    built = repo_config(config, environ={"REGISTRY_URL": "sqlite:////tmp/r.db", "REDIS_CONN": "redis:6379,password=x"})
    assert built.registry_config["path"] == "sqlite:////tmp/r.db"
    assert built.online_config["connection_string"] == "redis:6379,password=x"
    with pytest.raises(MissingEnvironment, match="REDIS_CONN is not set"):
        repo_config(config, environ={"REGISTRY_URL": "sqlite:////tmp/r.db"})


def test_expand_env_walks_nested_documents() -> None:
    assert expand_env({"a": ["${X}-1", 2], "b": {"c": "${X}"}}, {"X": "v"}) == {"a": ["v-1", 2], "b": {"c": "v"}}
