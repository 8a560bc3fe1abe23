"""The router's retrieval step against Feast's real feature server: a vector FeatureView applied and materialized
with the real Feast SDK into Loom's sqlite-vec store, served by Feast's own app (``POST /search``) on uvicorn; the
router (its HTTP app) embeds the question on an embedding service, searches that server and asks a chat service
(the embedding service and the chat service are stand-ins: a deterministic bag-of-words embedding, used for the
documents too, and a chat that echoes its prompt). The official `openai` client asks through the graph: the
documents Feast finds nearest are the ones in the prompt, nearest first, with their ids and scores in the answer; a
metadata filter and a score threshold keep the right ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pandas as pd
import pytest

from loom.workloads.features import commands
from loom.workloads.features.config import FeaturesConfig
from loom.workloads.router.app import build_app
from loom.workloads.router.config import RouterConfig
from loom.workloads.router.testing import FakeChat, FakeVectorStore, bag_of_words, serving

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

DIM = 32  # bag_of_words' dimension
END = datetime(2026, 1, 3, tzinfo=UTC)
DOCUMENTS = {
    "graphs#0": ("The router streams the answer of the last step of a graph.", "serving"),
    "graphs#1": ("A Switch node routes a request by a condition.", "serving"),
    "training#0": ("A training job resumes from its newest checkpoint.", "training"),
    "features#0": ("A feature view is materialized into the online store.", "features"),
    "scaling#0": ("A service scales to zero when nobody calls it.", "serving"),
}


def feast_project(folder: Path, source: Path) -> FeaturesConfig:
    return FeaturesConfig.model_validate({
        "project": "handbook",
        "registry": {"path": str(folder / "registry.db")},
        "onlineStore": {"path": str(folder / "online.db"), "vectorPath": str(folder / "vectors.db")},
        "repoPath": str(folder / "repo"),
        "featureViews": [{
            "name": "docs",
            "entities": [{"name": "chunk_id", "valueType": "String"}],
            "features": [
                {"name": "text", "dtype": "String"},
                {"name": "topic", "dtype": "String"},
                {"name": "embedding", "dtype": "Array(Float32)"},
            ],
            "source": {"path": str(source)},
            "ttlSeconds": 0,
            "vector": {"field": "embedding", "dimension": DIM, "metric": "cosine", "textField": "text"},
        }],
    })


@pytest.fixture(scope="module")
def feast_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from feast.feature_server import get_app

    folder = tmp_path_factory.mktemp("feast")
    pd.DataFrame({
        "chunk_id": list(DOCUMENTS),
        "text": [text for text, _ in DOCUMENTS.values()],
        "topic": [topic for _, topic in DOCUMENTS.values()],
        "embedding": [np.asarray(bag_of_words(text), dtype=np.float32) for text, _ in DOCUMENTS.values()],
        "event_timestamp": [END - timedelta(hours=1)] * len(DOCUMENTS),
    }).to_parquet(folder / "docs.parquet", index=False)
    config = feast_project(folder / "store", folder / "docs.parquet")
    store = commands.open_store(config)
    assert commands.apply(store, config)["outcome"] == "Applied"
    commands.materialize(store, config, start=END - timedelta(days=1), end=END)
    with serving(get_app(store)) as url:
        yield url


@pytest.fixture(scope="module")
def stand_ins() -> Iterator[dict[str, Any]]:
    embedder, chat = FakeVectorStore({}), FakeChat("llm:")
    with serving(embedder.app()) as embed_url, serving(chat.app()) as chat_url:
        yield {"embed_url": embed_url, "chat": chat, "chat_url": chat_url}


def router(feast_url: str, stand_ins: dict[str, Any], **retrieve: Any) -> Any:
    store = {
        "searchUrl": f"{feast_url}/search", "featureRefs": ["docs:text", "docs:topic"], "textField": "text",
        "metric": "cosine", "embedding": {"url": f"{stand_ins['embed_url']}/v1/embeddings", "modelName": "bow"},
    }
    config = RouterConfig.model_validate({
        "graphName": "ask",
        "nodes": {"root": {"routerType": "Sequence", "steps": [{
            "name": "answer", "serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard",
            "retrieve": {"featureView": "handbook", "promptTemplate": "{context}\n--\n{question}", **retrieve},
        }]}},
        "services": {"llm": {"url": stand_ins["chat_url"], "modelName": "llm"}},
        "stores": {"handbook": store},
    })
    return serving(build_app(config))


def exact(question: str) -> list[tuple[str, float]]:
    query = np.asarray(bag_of_words(question))
    scored = [(doc_id, float(query @ np.asarray(bag_of_words(text)))) for doc_id, (text, _) in DOCUMENTS.items()]
    return sorted(scored, key=lambda item: -item[1])


def ask(url: str, question: str) -> tuple[list[dict[str, Any]], Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="ask", messages=[{"role": "user", "content": question}]
    )
    return json.loads(raw.headers["loom-rag-sources"]), raw.parse()


def test_the_nearest_documents_feast_finds_are_the_prompts(feast_url: str, stand_ins: dict[str, Any]) -> None:
    question = "how does the router stream the answer of a graph"
    with router(feast_url, stand_ins, topK=2) as url:
        sources, completion = ask(url, question)
    want = exact(question)[:2]
    assert [s["id"] for s in sources] == [doc_id for doc_id, _ in want]
    # Loom's index answers the cosine distance: the score is the similarity exact search computes.
    assert [s["score"] for s in sources] == pytest.approx([score for _, score in want], abs=1e-5)
    prompt = stand_ins["chat"].requests[-1][0]["messages"][-1]["content"]
    assert prompt == (f"[1] (source: graphs#0)\n{DOCUMENTS['graphs#0'][0]}\n\n"
                      f"[2] (source: {want[1][0]})\n{DOCUMENTS[want[1][0]][0]}\n--\n{question}")
    assert completion.choices[0].message.content == "llm:" + prompt


def test_filters_and_threshold_over_feasts_answer(feast_url: str, stand_ins: dict[str, Any]) -> None:
    question = "the training job checkpoint"
    only_serving = [{"field": "topic", "values": ["serving"]}]
    with router(feast_url, stand_ins, topK=2, filters=only_serving) as url:
        sources, _ = ask(url, question)
    serving_docs = [doc for doc, _ in exact(question) if DOCUMENTS[doc][1] == "serving"]
    assert [s["id"] for s in sources] == serving_docs[:2]
    with router(feast_url, stand_ins, topK=5, minScore=0.5) as url:
        sources, _ = ask(url, question)
    assert [s["id"] for s in sources] == [doc for doc, score in exact(question) if score >= 0.5]
    assert [s["id"] for s in sources] == ["training#0"]
