"""Feast's sqlite online store with a working vector search: what a vector FeatureView's store runs.

``feature_store.yaml`` names this class (``online_store.type``:
``loom.workloads.features.vector_store.LoomSqliteOnlineStore``) when a view of the project has a vector field.
Everything else is Feast's own sqlite store; on top of it:

- every write (materialization, push, write-to-online-store) also upserts the view's vectors into its sqlite-vec index
  (:mod:`loom.workloads.features.vector_index`), keyed by the serialized entity key;
- ``retrieve_online_documents_v2`` (Feast's ``POST /search``) asks the index for the k nearest keys and reads their
  features with Feast's own ``online_read``, so the answer is the document's current row plus ``distance``;
- ``update`` (feast apply) creates the index with the field's ``vector_length`` and ``vector_search_metric``, and
  drops it with the view.

Metadata filters (Feast's ``ComparisonFilter``/``CompoundFilter``) are checked on the candidates the index returns:
with a filter the index is asked for ``FILTER_CANDIDATES`` times k, so a very selective filter may return fewer
than k documents.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Literal

from feast import Entity, FeatureView, RepoConfig
from feast.filter_models import ComparisonFilter, CompoundFilter
from feast.infra.key_encoding_utils import deserialize_entity_key, serialize_entity_key
from feast.infra.online_stores.sqlite import SqliteOnlineStore, SqliteOnlineStoreConfig
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Value as ValueProto
from feast.type_map import feast_value_type_to_python_type

from loom.workloads.features.vector_index import VectorIndex, connect

FILTER_CANDIDATES = 10
DEFAULT_METRIC = "cosine"


class LoomSqliteOnlineStoreConfig(SqliteOnlineStoreConfig):
    """Feast's sqlite store settings plus where the vector indexes live."""

    type: Literal["loom.workloads.features.vector_store.LoomSqliteOnlineStore"] = (
        "loom.workloads.features.vector_store.LoomSqliteOnlineStore"  # type: ignore[assignment]
    )
    vector_path: str = "vectors.db"


def vector_field(table: FeatureView) -> Any | None:
    """The view's one vector field (``vector_index`` set), or None."""
    fields = [f for f in table.features if getattr(f, "vector_index", False)]
    return fields[0] if fields else None


def metric_of(field: Any) -> str:
    return str(getattr(field, "vector_search_metric", None) or DEFAULT_METRIC).lower()


def document_key(entity_key: EntityKeyProto, version: int) -> str:
    return serialize_entity_key(entity_key, entity_key_serialization_version=version).hex()


def _python(value: ValueProto) -> Any:
    return feast_value_type_to_python_type(value)


def matches(filters: ComparisonFilter | CompoundFilter | None, row: dict[str, Any]) -> bool:
    """Whether a document's features (python values) pass Feast's filter model."""
    if filters is None:
        return True
    if isinstance(filters, CompoundFilter):
        results = (matches(f, row) for f in filters.filters)
        return all(results) if filters.type == "and" else any(results)
    value, wanted = row.get(filters.key), filters.value
    try:
        match filters.type:
            case "eq":
                return bool(value == wanted)
            case "ne":
                return bool(value != wanted)
            case "gt":
                return value is not None and bool(value > wanted)
            case "gte":
                return value is not None and bool(value >= wanted)
            case "lt":
                return value is not None and bool(value < wanted)
            case "lte":
                return value is not None and bool(value <= wanted)
            case "in":
                return value in list(wanted)
            case "nin":
                return value not in list(wanted)
    except TypeError:
        return False
    return False


class LoomSqliteOnlineStore(SqliteOnlineStore):
    _index_db: Any = None
    _lock = threading.Lock()

    def _index(self, config: RepoConfig, table: FeatureView) -> VectorIndex:
        with self._lock:
            if self._index_db is None:
                self._index_db = connect(str(config.online_store.vector_path))
        return VectorIndex(self._index_db, config.project, table.name)

    def online_write_batch(
        self,
        config: RepoConfig,
        table: FeatureView,
        data: list[tuple[EntityKeyProto, dict[str, ValueProto], datetime, datetime | None]],
        progress: Callable[[int], Any] | None,
    ) -> None:
        super().online_write_batch(config, table, data, progress)
        field = vector_field(table)
        if field is None:
            return
        index = self._index(config, table)
        index.ensure(int(field.vector_length), metric_of(field))
        version = config.entity_key_serialization_version
        rows = [
            (document_key(key, version), list(values[field.name].float_list_val.val))
            for key, values, _, _ in data
            if field.name in values and values[field.name].HasField("float_list_val")
        ]
        index.upsert(rows, int(field.vector_length))

    def update(
        self,
        config: RepoConfig,
        tables_to_delete: Sequence[FeatureView],
        tables_to_keep: Sequence[FeatureView],
        entities_to_delete: Sequence[Entity],
        entities_to_keep: Sequence[Entity],
        partial: bool,
    ) -> None:
        super().update(config, tables_to_delete, tables_to_keep, entities_to_delete, entities_to_keep, partial)
        for table in tables_to_keep:
            field = vector_field(table)
            if field is not None:
                self._index(config, table).ensure(int(field.vector_length), metric_of(field))
        for table in tables_to_delete:
            self._index(config, table).drop()

    def retrieve_online_documents_v2(
        self,
        config: RepoConfig,
        table: FeatureView,
        requested_features: list[str],
        embedding: list[float] | None,
        top_k: int,
        distance_metric: str | None = None,
        query_string: str | None = None,
        filters: ComparisonFilter | CompoundFilter | None = None,
        include_feature_view_version_metadata: bool = False,
    ) -> list[tuple[datetime | None, EntityKeyProto | None, dict[str, ValueProto] | None]]:
        field = vector_field(table)
        if field is None:
            raise ValueError(f"feature view {table.name!r} has no vector field")
        if embedding is None:
            raise ValueError("this store searches by vector: give 'query' (the embedded question)")
        if len(embedding) != int(field.vector_length):
            raise ValueError(
                f"the query has {len(embedding)} dimensions; feature view {table.name!r}'s vectors have "
                f"{field.vector_length}"
            )
        index = self._index(config, table)
        wanted = top_k * FILTER_CANDIDATES if filters is not None else top_k
        hits = index.search(embedding, wanted)
        if not hits:
            return []
        version = config.entity_key_serialization_version
        keys = [deserialize_entity_key(bytes.fromhex(key), version) for key, _ in hits]
        rows = self.online_read(config, table, keys)
        documents: list[tuple[datetime | None, EntityKeyProto | None, dict[str, ValueProto] | None]] = []
        for key, (_, distance), (event_ts, values) in zip(keys, hits, rows, strict=True):
            if values is None:  # in the index but gone from the table (a deleted row): not a document any more
                continue
            if filters is not None and not matches(filters, {n: _python(v) for n, v in values.items()}):
                continue
            picked = {n: v for n, v in values.items() if not requested_features or n in requested_features}
            picked["distance"] = ValueProto(float_val=distance)
            documents.append((event_ts, key, picked))
            if len(documents) == top_k:
                break
        # Feast's response assembly (FeatureStore._retrieve_from_online_store_v2) places the features of the i-th
        # document at the position of the i-th entity in sorted order, but the join keys in the given order: only
        # documents already sorted by entity value come out aligned. So the answer is ordered by key; a client
        # orders by distance.
        documents.sort(key=lambda doc: entity_sort_key(doc[1]))
        return documents


def entity_sort_key(key: EntityKeyProto | None) -> tuple[Any, ...]:
    """The order Feast groups entity rows in (feast.utils._get_unique_entities_from_values)."""
    if key is None:
        return ()
    return tuple(getattr(value, str(value.WhichOneof("val"))) for value in key.entity_values)
