"""Retrieved documents: reading Feast's search answer, scoring, filtering, and telling the caller which were used.

Pure functions. Feast's ``POST /search`` (api_version 2) answers column-wise::

    {"metadata": {"feature_names": ["chunk_id", "text", "section", "distance"]},
     "results": [{"values": ["a#0", "b#1"]}, {"values": ["...", "..."]}, {"values": [...]}, {"values": [0.1, 0.4]}]}

Column ``j`` of ``results`` holds feature ``feature_names[j]`` of every document, in the store's order (nearest
first). The document's id is the entity (join key) column: the one that is neither a requested feature nor the
distance. Requested feature names may come back as ``<view>__<feature>`` or ``<view>:<feature>``: both are read as
the feature's name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .retrieval_config import MetadataFilter

DISTANCE = "distance"
# The response header naming the documents the answer was given from (JSON, ASCII only).
SOURCES_HEADER = "loom-rag-sources"
# Set when the step answered without context (retrieval failed and onFailure is AnswerWithoutContext): why.
DEGRADED_HEADER = "loom-rag-degraded"
# The field of a (non-streaming) chat completion that carries the same list; OpenAI clients keep unknown fields.
SOURCES_FIELD = "loom_sources"


class StoreAnswerError(ValueError):
    """The store answered something that is not Feast's search response."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    distance: float
    score: float
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """One document as the caller sees it: which, how near, and whether the prompt holds only its beginning."""

    id: str
    score: float
    truncated: bool = False

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id, "score": round(self.score, 6)}
        if self.truncated:
            doc["truncated"] = True
        return doc


def score_of(distance: float, metric: str) -> float:
    """Higher is nearer. Cosine: the cosine similarity (1 - cosine distance); any other metric: 1 / (1 + d),
    which maps a distance >= 0 into (0, 1]."""
    if metric.lower() == "cosine":
        return 1.0 - distance
    return 1.0 / (1.0 + max(distance, 0.0))


def _feature_name(name: str) -> str:
    for separator in (":", "__"):
        if separator in name:
            return name.rsplit(separator, 1)[1]
    return name


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def parse_search(answer: Any, feature_refs: Sequence[str], text_field: str, metric: str) -> list[Document]:
    """Feast's column-wise search answer as documents, nearest first."""
    if not isinstance(answer, dict):
        raise StoreAnswerError("the store's answer is not a JSON object")
    names = (answer.get("metadata") or {}).get("feature_names")
    results = answer.get("results")
    if isinstance(names, dict) and "val" in names:  # protobuf's raw form, which Feast may send unpatched
        names = names["val"]
    if not isinstance(names, list) or not isinstance(results, list) or len(names) != len(results):
        raise StoreAnswerError("the store's answer lacks metadata.feature_names and results of equal length")
    columns: dict[str, list[Any]] = {}
    for name, result in zip(names, results, strict=True):
        values = result.get("values") if isinstance(result, dict) else None
        if not isinstance(values, list):
            raise StoreAnswerError(f"column {name!r} of the store's answer has no values")
        columns[_feature_name(str(name))] = values
    if DISTANCE not in columns:
        raise StoreAnswerError("the store's answer has no distance column")
    if text_field not in columns:
        raise StoreAnswerError(f"the store's answer has no column {text_field!r} (the text)")
    requested = {_feature_name(ref) for ref in feature_refs}
    id_columns = [name for name in columns if name not in requested and name != DISTANCE]
    count = len(columns[DISTANCE])
    if any(len(values) != count for values in columns.values()):
        raise StoreAnswerError("the store's answer has columns of different lengths")
    documents = []
    for row in range(count):
        raw = columns[DISTANCE][row]
        if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
            continue  # an empty slot (fewer documents than asked for)
        text = _text(columns[text_field][row])
        doc_id = _text(columns[id_columns[0]][row]) if id_columns else f"#{row}"
        metadata = {
            name: _text(values[row]) for name, values in columns.items() if name not in (DISTANCE, text_field)
        }
        documents.append(Document(doc_id, text, float(raw), score_of(float(raw), metric), metadata))
    documents.sort(key=lambda d: d.distance)
    return documents


def _passes(document: Document, filters: Sequence[MetadataFilter]) -> bool:
    for rule in filters:
        value = document.metadata.get(rule.field)
        inside = value is not None and value in rule.values
        if inside != (rule.operator == "In"):
            return False
    return True


def select(
    documents: Sequence[Document], top_k: int, min_score: float | None, filters: Sequence[MetadataFilter]
) -> list[Document]:
    """The documents to use: those passing every filter and the threshold, nearest first, at most ``top_k``."""
    kept = [
        d for d in documents if (min_score is None or d.score >= min_score) and _passes(d, filters)
    ]
    return kept[:top_k]


def candidates(top_k: int, filters: Sequence[MetadataFilter]) -> int:
    """How many documents to ask the store for: filters are applied here, so over-fetch to still fill ``top_k``."""
    return top_k if not filters else min(top_k * 4, 200)


def sources_header(sources: Sequence[Source]) -> str:
    """The header value: a compact JSON list, ASCII only (a header carries no other text safely)."""
    return json.dumps([s.to_json() for s in sources], separators=(",", ":"), ensure_ascii=True)


def with_sources(body: bytes, sources: Sequence[Source]) -> bytes:
    """A chat completion's JSON with ``loom_sources`` added; a body that is not a JSON object is left as it is."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body
    if not isinstance(doc, dict):
        return body
    doc[SOURCES_FIELD] = [s.to_json() for s in sources]
    return json.dumps(doc, separators=(",", ":")).encode()
