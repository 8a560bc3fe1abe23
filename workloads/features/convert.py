"""Pure conversion of the Loom contract into Feast SDK objects and a Feast RepoConfig (no I/O).

Every Feast object a command applies is built here, so the unit tests of this module pin exactly what
reaches the registry: entities with their join key and value type, a FileSource with its timestamp
columns, and a FeatureView with its schema, ttl, online flag, tags, description and owner.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from feast import Entity, FeatureView, Field, FileSource, RepoConfig, ValueType
from feast import types as feast_types

from loom.workloads.features.config import (
    ENTITY_DTYPES,
    SCALAR_DTYPES,
    FeaturesConfig,
    FeatureViewConfig,
    check_dtype,
)

# Tag every object Loom writes, so a person reading the registry knows who keeps it in step.
MANAGED_BY_KEY = "app.kubernetes.io/managed-by"
MANAGED_BY_TAG = {MANAGED_BY_KEY: "loom"}

_SCALARS: dict[str, Any] = {name: getattr(feast_types, name) for name in SCALAR_DTYPES}
_ENTITY_VALUE_TYPES: dict[str, ValueType] = {
    "Int32": ValueType.INT32,
    "Int64": ValueType.INT64,
    "String": ValueType.STRING,
    "Bytes": ValueType.BYTES,
    "UnixTimestamp": ValueType.UNIX_TIMESTAMP,
}
_ARRAY = re.compile(r"^Array\((\w+)\)$")
_ENV_REFERENCE = re.compile(r"\$\{(\w+)\}")


class MissingEnvironment(ValueError):
    """A ``${VAR}`` in the store configuration names a variable the pod does not have."""


def feast_dtype(dtype: str, where: str) -> Any:
    """The feast.types object for a dtype name ("Float32", "Array(Int64)"); an error names ``where``."""
    check_dtype(dtype, where)
    match = _ARRAY.match(dtype)
    if match:
        return feast_types.Array(_SCALARS[match.group(1)])
    return _SCALARS[dtype]


def entity_value_type(dtype: str, where: str) -> ValueType:
    check_dtype(dtype, where, ENTITY_DTYPES)
    return _ENTITY_VALUE_TYPES[dtype]


def to_entities(view: FeatureViewConfig) -> list[Entity]:
    return [
        Entity(
            name=entity.name,
            join_keys=[entity.join_key],
            value_type=entity_value_type(entity.value_type, f"entity {entity.name!r}"),
            description=entity.description,
            tags={**entity.tags, **MANAGED_BY_TAG},
        )
        for entity in view.entities
    ]


def to_source(view: FeatureViewConfig) -> FileSource:
    source = view.source
    # An embedded view's Feast source is the chunks its materialization writes, not the documents.
    embedding = view.vector.embedding if view.vector is not None else None
    return FileSource(
        # One source per view: the name shows up in the registry and in Feast's error messages.
        name=f"{view.name}_source",
        path=embedding.output_path if embedding is not None else source.path,
        timestamp_field=source.timestamp_field,
        created_timestamp_column=source.created_timestamp_field or "",
        s3_endpoint_override=source.endpoint if source.is_s3 and embedding is None else None,
        tags=dict(MANAGED_BY_TAG),
    )


def vector_options(view: FeatureViewConfig, feature: str) -> dict[str, Any]:
    """Feast's vector settings for the view's vector field (none for other features)."""
    if view.vector is None or view.vector.field != feature:
        return {}
    return {
        "vector_index": True,
        "vector_length": view.vector.dimension,
        "vector_search_metric": view.vector.metric,
    }


def to_feature_view(view: FeatureViewConfig, entities: list[Entity] | None = None) -> FeatureView:
    """The Feast FeatureView. Its schema lists the join keys with their types, then every feature."""
    entities = entities if entities is not None else to_entities(view)
    where = f"feature view {view.name!r}"
    schema = [
        Field(name=entity.join_key, dtype=feast_dtype(entity.value_type, f"{where} entity {entity.name!r}"))
        for entity in view.entities
    ] + [
        Field(
            name=feature.name,
            dtype=feast_dtype(feature.dtype, f"{where} feature {feature.name!r}"),
            description=feature.description,
            tags=feature.tags,
            **vector_options(view, feature.name),
        )
        for feature in view.features
    ]
    return FeatureView(
        name=view.name,
        entities=entities,
        schema=schema,
        source=to_source(view),
        ttl=timedelta(seconds=view.ttl_seconds),
        online=view.online,
        description=view.description,
        owner=view.owner,
        tags={**view.tags, **MANAGED_BY_TAG},
    )


def to_feast_objects(view: FeatureViewConfig) -> tuple[list[Entity], FeatureView]:
    entities = to_entities(view)
    return entities, to_feature_view(view, entities)


def expand_env(document: Any, environ: Mapping[str, str]) -> Any:
    """``${VAR}`` replaced from ``environ`` in every string of a YAML-like document; unset is an error
    (Feast's own expansion would leave the text as is and fail later with a confusing connection error)."""
    if isinstance(document, dict):
        return {key: expand_env(value, environ) for key, value in document.items()}
    if isinstance(document, list):
        return [expand_env(value, environ) for value in document]
    if isinstance(document, str):
        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in environ:
                raise MissingEnvironment(f"environment variable {name} is not set (it should come from a Secret)")
            return environ[name]

        return _ENV_REFERENCE.sub(replace, document)
    return document


def repo_config(config: FeaturesConfig, environ: Mapping[str, str] | None = None) -> RepoConfig:
    """Feast's RepoConfig from the same document as ``feature_store.yaml``, secrets filled in from env."""
    document = expand_env(config.feature_store_yaml(), os.environ if environ is None else environ)
    return RepoConfig(repo_path=config.repo_path, **document)
