"""Vector FeatureViews on the real Feast SDK and real sqlite-vec: apply, materialize, and Feast's own HTTP search
(``POST /search``, api_version 2, through Feast's feature server app) answering what exact search (numpy) answers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from feast import FeatureStore
from feast.feature_server import get_app

from loom.workloads.features import commands
from loom.workloads.features.config import FeaturesConfig
from loom.workloads.features.vector_index import VectorIndex, connect

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

N, DIM = 60, 8
END = datetime(2026, 1, 3, tzinfo=UTC)


def documents(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(N, DIM)).astype(np.float32)
    return pd.DataFrame({
        "doc_id": [f"d{i:03d}" for i in range(N)],
        "text": [f"text of document {i}" for i in range(N)],
        "topic": ["even" if i % 2 == 0 else "odd" for i in range(N)],
        "embedding": list(vectors),
        "event_timestamp": [END - timedelta(hours=1)] * N,
    })


def project(folder: Path, source: str, metric: str = "cosine") -> FeaturesConfig:
    return FeaturesConfig.model_validate({
        "project": "rag",
        "registry": {"path": str(folder / "registry.db")},
        "onlineStore": {"path": str(folder / "online.db"), "vectorPath": str(folder / "vectors.db")},
        "repoPath": str(folder / "repo"),
        "featureViews": [{
            "name": "docs",
            "entities": [{"name": "doc_id", "valueType": "String"}],
            "features": [
                {"name": "text", "dtype": "String"},
                {"name": "topic", "dtype": "String"},
                {"name": "embedding", "dtype": "Array(Float32)"},
            ],
            "source": {"path": source},
            "ttlSeconds": 0,
            "vector": {"field": "embedding", "dimension": DIM, "metric": metric, "textField": "text"},
        }],
    })


@pytest.fixture
def served(tmp_path: Path) -> tuple[FeaturesConfig, FeatureStore, pd.DataFrame, TestClient]:
    frame = documents()
    frame.to_parquet(tmp_path / "docs.parquet", index=False)
    config = project(tmp_path / "store", str(tmp_path / "docs.parquet"))
    store = commands.open_store(config)
    assert commands.apply(store, config)["outcome"] == "Applied"
    result = commands.materialize(store, config, start=END - timedelta(days=1), end=END)
    assert result["featureViews"][0]["vectorIndex"] == {
        "documents": N, "dimension": DIM, "metric": "cosine", "model": None, "reembed": 0,
    }
    return config, store, frame, TestClient(get_app(store))


def exact(frame: pd.DataFrame, query: np.ndarray, k: int, metric: str = "cosine") -> list[tuple[str, float]]:
    vectors = np.stack(frame["embedding"].to_list()).astype(np.float64)
    if metric == "cosine":
        distances = 1 - vectors @ query / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(query))
    else:
        distances = np.linalg.norm(vectors - query, axis=1)
    order = np.argsort(distances)[:k]
    return [(str(frame["doc_id"][i]), float(distances[i])) for i in order]


def search(client: TestClient, query: list[float], k: int, **extra: Any) -> list[dict[str, Any]]:
    """Feast's columnar answer as rows, nearest first."""
    answer = client.post("/search", json={
        "features": ["docs:text", "docs:topic"], "query": query, "top_k": k, "api_version": 2, **extra,
    })
    assert answer.status_code == 200, answer.text
    body = answer.json()
    names = body["metadata"]["feature_names"]
    columns = [r["values"] for r in body["results"]]
    rows = [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]
    return sorted(rows, key=lambda row: row["distance"])


def test_search_answers_the_exact_nearest_documents_with_their_own_features(served: Any) -> None:
    _, _, frame, client = served
    rng = np.random.default_rng(7)
    for _ in range(5):
        query = rng.normal(size=DIM)
        rows = search(client, [float(x) for x in query], 5)
        want = exact(frame, query, 5)
        assert [r["doc_id"] for r in rows] == [doc for doc, _ in want]
        assert [r["distance"] for r in rows] == pytest.approx([d for _, d in want], abs=1e-5)
        for row in rows:  # each document's features belong to that document (Feast's assembly misaligns otherwise)
            number = int(row["doc_id"][1:])
            assert row["text"] == f"text of document {number}"
            assert row["topic"] == ("even" if number % 2 == 0 else "odd")


def test_a_filter_keeps_only_matching_documents(served: Any) -> None:
    _, _, frame, client = served
    query = [float(x) for x in frame["embedding"][3]]
    rows = search(client, query, 3, filters={"key": "topic", "type": "eq", "value": "even"})
    assert len(rows) == 3 and {r["topic"] for r in rows} == {"even"}
    evens = frame[frame["topic"] == "even"].reset_index(drop=True)
    assert [r["doc_id"] for r in rows] == [doc for doc, _ in exact(evens, np.asarray(query, dtype=np.float64), 3)]


def test_a_query_of_another_dimension_is_refused_with_both_numbers(served: Any) -> None:
    _, store, _, _ = served
    with pytest.raises(ValueError, match=r"the query has 3 dimensions; feature view 'docs'.s vectors have 8"):
        store.retrieve_online_documents_v2(features=["docs:text"], query=[1.0, 0.0, 0.0], top_k=2)


def test_materializing_new_vectors_replaces_a_documents_vector_never_duplicates(served: Any, tmp_path: Path) -> None:
    config, store, frame, client = served
    moved = frame.copy()
    target = np.zeros(DIM, dtype=np.float32)
    target[0] = 1.0
    moved["embedding"] = [target if i == 10 else v for i, v in enumerate(moved["embedding"])]  # d010 on one axis
    moved["event_timestamp"] = END - timedelta(minutes=30)
    moved.to_parquet(tmp_path / "docs.parquet", index=False)
    commands.materialize(store, config, start=END - timedelta(days=1), end=END)
    rows = search(client, [float(x) for x in target], 1)
    assert rows[0]["doc_id"] == "d010" and rows[0]["distance"] == pytest.approx(0.0, abs=1e-6)
    index = VectorIndex(connect(config.online_store.vector_path), config.project, "docs")
    assert index.count() == N


def test_deleting_the_view_drops_its_index(served: Any) -> None:
    config, store, _, _ = served
    commands.delete(store, config, ["docs"])
    assert VectorIndex(connect(config.online_store.vector_path), config.project, "docs").meta() is None


def test_l2_metric(tmp_path: Path) -> None:
    frame = documents(seed=3)
    frame.to_parquet(tmp_path / "docs.parquet", index=False)
    config = project(tmp_path / "store", str(tmp_path / "docs.parquet"), metric="l2")
    store = commands.open_store(config)
    commands.apply(store, config)
    commands.materialize(store, config, start=END - timedelta(days=1), end=END)
    query = np.random.default_rng(1).normal(size=DIM)
    rows = search(TestClient(get_app(store)), [float(x) for x in query], 4)
    want = exact(frame, query, 4, metric="l2")
    assert [r["doc_id"] for r in rows] == [doc for doc, _ in want]
    assert [r["distance"] for r in rows] == pytest.approx([d for _, d in want], abs=1e-4)
