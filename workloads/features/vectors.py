"""The vector steps of ``materialize``: embed an embedded view's documents before Feast runs, report the index after.

For an embedded view: the index's model is compared with the service's (:func:`embedding.reembed_decision`), the
documents are chunked and embedded, the chunks written to the view's Feast source, and chunks that no longer exist
are dropped from the index. Feast then materializes the whole ttl window (not incrementally: a re-embedded chunk
keeps its document's timestamp, which an incremental run would skip), and :func:`finish` records the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from loom.workloads.features.config import FeaturesConfig, FeatureViewConfig
from loom.workloads.features.embedding import (
    Decision,
    EmbeddingClient,
    embed_documents,
    reembed_decision,
)
from loom.workloads.features.vector_index import VectorIndex, connect

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def open_index(config: FeaturesConfig, view: FeatureViewConfig) -> VectorIndex:
    assert view.vector is not None
    index = VectorIndex(connect(config.online_store.vector_path), config.project, view.name)
    index.ensure(view.vector.dimension, view.vector.metric)
    return index


@dataclass(frozen=True)
class Prepared:
    """An embedded view, ready for Feast to materialize."""

    view: str
    model: str
    reembed: int
    decision: Decision
    embedded: int
    reused: int
    chunks: int


def prepare(config: FeaturesConfig, view: FeatureViewConfig, end: datetime, read: Any, write: Any) -> Prepared:
    """Embed the view's documents into its Feast source (``read``/``write`` move parquet frames)."""
    vector = view.vector
    assert vector is not None and vector.embedding is not None
    embedding = vector.embedding
    client = EmbeddingClient.of(embedding)
    model = client.identity()
    # Read, not ensured: a view whose dimension is wrong must fail below before its index is touched.
    index = VectorIndex(connect(config.online_store.vector_path), config.project, view.name)
    meta = index.meta()
    decision = reembed_decision(meta, model, embedding.reembed)
    if decision == "keep" and meta is not None and (meta.dimension, meta.metric) != (vector.dimension, vector.metric):
        decision = "fresh"  # another dimension or metric: a new index, every chunk embedded again
    documents = read(view.source.path, view.source.endpoint)
    result = embed_documents(view, documents, client, decision, end)
    frame = result.frame
    frame[vector.field] = [np.asarray(v, dtype=np.float32) for v in frame[vector.field]]
    write(frame, embedding.output_path)
    index.ensure(vector.dimension, vector.metric)
    if decision == "rebuild":
        index.clear()
    key_of = chunk_keys(view, config)
    current = {key_of(str(chunk)) for chunk in frame[view.entities[0].join_key]}
    index.delete(index.keys() - current)
    previous = meta.reembed if meta is not None else 0
    if decision == "keep" and meta is not None and meta.model is not None and "@" not in model:
        model = meta.model  # the same model, known less precisely this run: keep the fuller identity
    return Prepared(view.name, model, max(previous, embedding.reembed), decision, result.embedded, result.reused,
                    len(frame))


def chunk_keys(view: FeatureViewConfig, config: FeaturesConfig) -> Any:
    """Chunk id -> the index key Feast's write path gives it (the serialized entity key)."""
    from feast.infra.key_encoding_utils import serialize_entity_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value

    join_key = view.entities[0].join_key

    def key(chunk_id: str) -> str:
        proto = EntityKey(join_keys=[join_key], entity_values=[Value(string_val=chunk_id)])
        return serialize_entity_key(proto, entity_key_serialization_version=3).hex()

    return key


def window_start(view: FeatureViewConfig, end: datetime) -> datetime:
    """An embedded view is materialized over its whole ttl window (from the epoch when the ttl is 0)."""
    return EPOCH if view.ttl_seconds == 0 else max(EPOCH, end - timedelta(seconds=view.ttl_seconds))


def finish(config: FeaturesConfig, view: FeatureViewConfig, prepared: Prepared | None) -> dict[str, Any]:
    """Record the model of an embedded view's vectors; what the index holds, for status."""
    assert view.vector is not None
    index = open_index(config, view)
    if prepared is not None:
        index.record_model(prepared.model, prepared.reembed)
    meta = index.meta()
    report: dict[str, Any] = {
        "documents": meta.documents if meta else 0,
        "dimension": view.vector.dimension,
        "metric": view.vector.metric,
        "model": meta.model if meta else None,
        "reembed": meta.reembed if meta else 0,
    }
    if prepared is not None:
        report.update(
            {"chunks": prepared.chunks, "embedded": prepared.embedded, "reused": prepared.reused,
             "decision": prepared.decision}
        )
    return report
