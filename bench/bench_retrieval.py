"""Vector retrieval of a FeatureView (#51): latency p50/p99 and recall@k against exact search, 100,000 vectors.

A synthetic corpus (clustered unit vectors, so neighbours are meaningful) is materialized through Feast into the
store a vector FeatureView runs (Feast's sqlite online store with Loom's sqlite-vec index,
loom.workloads.features.vector_store), and queried three ways, each against exact search in numpy on the same
vectors in the same run (the baseline the ratios are against):

- index: the sqlite-vec KNN alone (VectorIndex.search), what one search costs in the store;
- feast: Feast's own POST /search (api_version 2) through Feast's feature server app, what a retrieval step calls:
  the KNN, the documents' features read back, Feast's response assembly.

recall@k = |returned ids ∩ exact top-k ids| / k, averaged over the queries. sqlite-vec's vec0 is an exact (brute
force) index, so recall is 1.0 up to float32 ties; the numbers that matter are the latencies and how they grow.

    PYTHONSAFEPATH=1 OMP_NUM_THREADS=1 .venv/bin/python bench/bench_retrieval.py [--vectors 100000] [--dim 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd

END = datetime(2026, 1, 3, tzinfo=UTC)


def corpus(n: int, dim: int, clusters: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    vectors = centers[rng.integers(0, clusters, n)] + 0.35 * rng.normal(size=(n, dim))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def exact_top_k(vectors: np.ndarray, query: np.ndarray, k: int) -> list[int]:
    distances = 1.0 - vectors @ query  # unit vectors: cosine distance
    top = np.argpartition(distances, k)[:k]
    return [int(i) for i in top[np.argsort(distances[top])]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()

    from fastapi.testclient import TestClient
    from feast.feature_server import get_app

    from loom.workloads.features import commands
    from loom.workloads.features.config import FeaturesConfig
    from loom.workloads.features.vector_index import VectorIndex, connect
    from loom.workloads.features.vectors import chunk_keys

    n, dim, k = args.vectors, args.dim, args.k
    vectors = corpus(n, dim, clusters=max(10, n // 100), seed=0)
    rng = np.random.default_rng(1)
    picks = rng.integers(0, n, args.queries)
    queries = vectors[picks] + 0.2 * rng.normal(size=(args.queries, dim)).astype(np.float32)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ids = [f"doc-{i:06d}" for i in range(n)]
        pd.DataFrame({
            "doc_id": ids,
            "title": [f"title {i}" for i in range(n)],
            "embedding": list(vectors),
            "event_timestamp": [END - timedelta(hours=1)] * n,
        }).to_parquet(root / "docs.parquet", index=False)
        config = FeaturesConfig.model_validate({
            "project": "bench",
            "registry": {"path": str(root / "registry.db")},
            "onlineStore": {"path": str(root / "online.db"), "vectorPath": str(root / "vectors.db")},
            "repoPath": str(root / "repo"),
            "featureViews": [{
                "name": "docs",
                "entities": [{"name": "doc_id", "valueType": "String"}],
                "features": [{"name": "title", "dtype": "String"}, {"name": "embedding", "dtype": "Array(Float32)"}],
                "source": {"path": str(root / "docs.parquet")},
                "ttlSeconds": 0,
                "vector": {"field": "embedding", "dimension": dim, "metric": "cosine", "textField": "title"},
            }],
        })
        store = commands.open_store(config)
        commands.apply(store, config)
        started = time.perf_counter()
        commands.materialize(store, config, start=END - timedelta(days=1), end=END)
        load_s = time.perf_counter() - started
        index = VectorIndex(connect(config.online_store.vector_path), config.project, "docs")
        assert index.count() == n, index.count()
        key_to_id = {chunk_keys(config.view("docs"), config)(doc): i for i, doc in enumerate(ids)}
        client = TestClient(get_app(store))

        timings: dict[str, list[float]] = {"exact (numpy)": [], "index (sqlite-vec)": [], "feast POST /search": []}
        recalls: dict[str, list[float]] = {"index (sqlite-vec)": [], "feast POST /search": []}
        for query in queries:
            t0 = time.perf_counter()
            truth = set(exact_top_k(vectors, query, k))
            timings["exact (numpy)"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            hits = index.search(query.tolist(), k)
            timings["index (sqlite-vec)"].append(time.perf_counter() - t0)
            recalls["index (sqlite-vec)"].append(len({key_to_id[key] for key, _ in hits} & truth) / k)

            body = {"features": ["docs:title"], "query": query.tolist(), "top_k": k, "api_version": 2}
            t0 = time.perf_counter()
            answer = client.post("/search", json=body)
            timings["feast POST /search"].append(time.perf_counter() - t0)
            answer.raise_for_status()
            doc = answer.json()
            column = doc["metadata"]["feature_names"].index("doc_id")
            found = {int(str(value).removeprefix("doc-")) for value in doc["results"][column]["values"]}
            recalls["feast POST /search"].append(len(found & truth) / k)

    base = percentile(timings["exact (numpy)"], 50)
    print(f"corpus: {n} vectors of {dim} (cosine), {args.queries} queries, k={k}; "
          f"materialized through Feast into sqlite + sqlite-vec in {load_s:.1f} s ({n / load_s:.0f} rows/s)")
    print(f"{'path':<22}{'p50 ms':>9}{'p99 ms':>9}{'p50 / exact':>13}{'recall@' + str(k):>11}")
    for name, values in timings.items():
        p50, p99 = percentile(values, 50) * 1e3, percentile(values, 99) * 1e3
        recall = f"{np.mean(recalls[name]):.3f}" if name in recalls else "1 (truth)"
        print(f"{name:<22}{p50:>9.1f}{p99:>9.1f}{p50 / (base * 1e3):>13.2f}{recall:>11}")


if __name__ == "__main__":
    main()
