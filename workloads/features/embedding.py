"""Embedding a view's documents during materialization: documents -> chunks -> vectors -> the view's Feast source.

An embedded view's source holds documents (an id, a text, a timestamp, metadata columns). Before Feast materializes,
every document is cut into chunks (:mod:`chunking`), each chunk embedded by an OpenAI-compatible
``POST <url>/v1/embeddings`` (the vllm runtime with a pooling model), and the chunks written as parquet to
``embedding.outputPath``, which is the Feast view's batch source. A chunk whose text is unchanged since the last run
keeps its vector (read back from that parquet) when the model is the same, so only new text is embedded.

The index records the model identity of its vectors (:mod:`vector_index`); :func:`reembed_decision` refuses to add
another model's vectors unless the view's ``reembed`` generation was raised, and then everything is re-embedded.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import pyarrow.parquet as pq

from loom.workloads.features.chunking import chunk_documents
from loom.workloads.features.config import (
    EXIT_INVALID_CONFIG,
    EmbeddingConfig,
    FeatureViewConfig,
    InvalidSource,
    VectorConfig,
    WorkloadError,
)
from loom.workloads.features.vector_index import IndexMeta

TIMEOUT_SECONDS = 60.0


class EmbeddingServiceUnreachable(WorkloadError):
    reason = "EmbeddingServiceUnreachable"


class DimensionMismatch(WorkloadError):
    exit_code = EXIT_INVALID_CONFIG
    reason = "DimensionMismatch"


class ReembedNeeded(WorkloadError):
    exit_code = EXIT_INVALID_CONFIG
    reason = "ReembedNeeded"


Decision = Literal["fresh", "keep", "rebuild"]


def same_model(recorded: str, current: str) -> bool:
    """Whether two model identities (``name`` or ``name@source``) are one model. When either lacks its source (the
    service's InferenceService could not be read that moment) only the names are compared: a passing gap in what
    is known is no reason to stop materialization."""
    if recorded == current:
        return True
    if "@" in recorded and "@" in current:
        return False
    return recorded.split("@", 1)[0] == current.split("@", 1)[0]


def reembed_decision(meta: IndexMeta | None, model: str, reembed: int) -> Decision:
    """What to do with the index before embedding with ``model``: an index never holds two models' vectors.

    fresh: nothing embedded yet. keep: same model, reuse unchanged chunks' vectors. rebuild: another model's vectors
    and the user raised ``reembed`` above the generation that built them. Otherwise :class:`ReembedNeeded`."""
    if meta is None or meta.model is None or meta.documents == 0:
        return "fresh"
    if same_model(meta.model, model):
        return "keep"
    if reembed > meta.reembed:
        return "rebuild"
    raise ReembedNeeded(
        f"the index holds vectors of model {meta.model!r} and the embedding service now serves {model!r}; "
        f"set spec.vector.embedding.reembed to {meta.reembed + 1} to re-embed every document"
    )


@dataclass
class EmbeddingClient:
    """The OpenAI embeddings API of one service, with the standard library only (the Feast image stays small)."""

    url: str
    model: str
    api_key: str | None = None
    timeout: float = TIMEOUT_SECONDS
    source: str | None = None  # where the model comes from, when the operator knows (EmbeddingConfig.modelSource)

    @classmethod
    def of(cls, config: EmbeddingConfig) -> EmbeddingClient:
        # The Secret may be an InferenceService's key list (one key per line): its first key is the view's.
        text = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        key = next((line.strip() for line in text.splitlines() if line.strip()), None)
        return cls(config.url.rstrip("/"), config.model, key, source=config.model_source)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise WorkloadError(
                f"embedding service {self.url} answered {method} {path} with {error.code}: {detail}"
            ) from error
        except (urllib.error.URLError, OSError) as error:
            raise EmbeddingServiceUnreachable(
                f"embedding service {self.url} is unreachable ({method} {path}): {error}"
            ) from error

    def identity(self) -> str:
        """The served model as the index records it: its name, and where the model comes from (the operator's
        ``source``, else the weights the server says it loaded: vLLM's ``root``), so a new model under the same name
        still counts as another model."""
        listing = self._call("GET", "/v1/models")
        for entry in listing.get("data") or []:
            if entry.get("id") == self.model:
                origin = self.source or entry.get("root")
                return f"{self.model}@{origin}" if origin and origin != self.model else self.model
        served = ", ".join(str(e.get("id")) for e in listing.get("data") or [])
        raise WorkloadError(f"embedding service {self.url} does not serve model {self.model!r} (it serves: {served})")

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        answer = self._call("POST", "/v1/embeddings", {"model": self.model, "input": list(texts)})
        data = sorted(answer.get("data") or [], key=lambda item: int(item.get("index", 0)))
        if len(data) != len(texts):
            raise WorkloadError(f"embedding service {self.url} returned {len(data)} vectors for {len(texts)} texts")
        return [[float(x) for x in item["embedding"]] for item in data]


def document_columns(view: FeatureViewConfig, vector: VectorConfig, embedding: EmbeddingConfig) -> list[str]:
    """The columns an embedded view's documents must have: id, text, timestamps, and every copied feature."""
    produced = {vector.field, vector.text_field, view.entities[0].join_key}
    copied = [f.name for f in view.features if f.name not in produced]
    timestamps = [view.source.timestamp_field] + (
        [view.source.created_timestamp_field] if view.source.created_timestamp_field else []
    )
    return [embedding.document_column, embedding.text_column, *timestamps, *copied]


def check_documents(view: FeatureViewConfig, read: Any) -> dict[str, str]:
    """The documents source's columns; a missing one is an error naming it (``read`` reads a parquet schema)."""
    assert view.vector is not None and view.vector.embedding is not None
    columns: dict[str, str] = read(view.source.path, view.source.endpoint)
    wanted = document_columns(view, view.vector, view.vector.embedding)
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise InvalidSource(
            f"feature view {view.name!r}: documents {view.source.path} have no column {', '.join(map(repr, missing))}; "
            f"their columns are {', '.join(sorted(columns))}"
        )
    return columns


def previous_vectors(path: str, text_field: str, vector_field: str, key: str) -> dict[str, tuple[str, list[float]]]:
    """Chunk id -> (text, vector) from the last run's output, if any."""
    if not Path(path).exists():
        return {}
    frame = pq.read_table(path, columns=[key, text_field, vector_field]).to_pandas()
    rows = zip(frame[key], frame[text_field], frame[vector_field], strict=True)
    return {str(k): (str(t), [float(x) for x in v]) for k, t, v in rows}


@dataclass(frozen=True)
class Embedded:
    frame: pd.DataFrame  # the chunks as the view's source rows
    embedded: int  # chunks sent to the service
    reused: int  # chunks whose vector was kept


def embed_documents(
    view: FeatureViewConfig,
    documents: pd.DataFrame,
    client: EmbeddingClient,
    decision: Decision,
    end: datetime,
) -> Embedded:
    """The view's chunk rows for ``documents`` (those with a timestamp at or before ``end``), embedded."""
    vector, embedding = view.vector, view.vector.embedding if view.vector else None
    assert vector is not None and embedding is not None and vector.text_field is not None
    key = view.entities[0].join_key
    stamps = pd.to_datetime(documents[view.source.timestamp_field], utc=True)
    documents = documents[stamps <= pd.Timestamp(end)].reset_index(drop=True)
    chunks = chunk_documents(
        [(str(d), str(t)) for d, t in zip(documents[embedding.document_column], documents[embedding.text_column],
                                           strict=True)],
        embedding.chunking.size,
        embedding.chunking.overlap,
    )
    known = (
        previous_vectors(embedding.output_path, vector.text_field, vector.field, key) if decision == "keep" else {}
    )
    vectors: dict[str, list[float]] = {}
    todo = []
    for chunk in chunks:
        cached = known.get(chunk.chunk_id)
        if cached is not None and cached[0] == chunk.text:
            vectors[chunk.chunk_id] = cached[1]
        else:
            todo.append(chunk)
    for first in range(0, len(todo), embedding.batch_size):
        batch = todo[first : first + embedding.batch_size]
        answers = client.embed([c.text for c in batch])
        if answers and len(answers[0]) != vector.dimension:
            raise DimensionMismatch(
                f"feature view {view.name!r} declares vector.dimension {vector.dimension} but model "
                f"{client.model!r} at {client.url} returns vectors of {len(answers[0])} dimensions"
            )
        vectors.update({c.chunk_id: v for c, v in zip(batch, answers, strict=True)})
    by_document = documents.set_index(embedding.document_column, drop=False)
    carried = [c for c in document_columns(view, vector, embedding)[2:]]
    rows = []
    for chunk in chunks:
        source = by_document.loc[chunk.document_id]
        if isinstance(source, pd.DataFrame):  # a document id given twice: its newest row
            source = source.sort_values(view.source.timestamp_field).iloc[-1]
        row = {column: source[column] for column in carried}
        row.update({key: chunk.chunk_id, vector.text_field: chunk.text, vector.field: vectors[chunk.chunk_id]})
        rows.append(row)
    columns = [key, vector.text_field, vector.field, *carried]
    return Embedded(pd.DataFrame(rows, columns=columns), embedded=len(todo), reused=len(chunks) - len(todo))
