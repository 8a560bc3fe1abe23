"""The retrieval step through the router, over HTTP, with the official `openai` client: a fake embedding service and
Feast search (FakeVectorStore) and a fake chat service (FakeChat, which echoes its prompt) served by uvicorn on
127.0.0.1. The answer carries its sources (a header and a field), streaming included; failures of the embedding
service or the store fail the request naming the step, or degrade to an answer without context when configured; a
question over the prompt budget is a 400 naming the limit; the per-step metrics count what happened."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from loom.workloads.router.app import build_app
from loom.workloads.router.config import RouterConfig
from loom.workloads.router.testing import FakeChat, FakeVectorStore, serving

DOCUMENTS = {
    "loom#0": ("Loom runs training jobs as Kubernetes objects.", "training"),
    "loom#1": ("The router executes an inference graph of services.", "serving"),
    "loom#2": ("Feature views are registered in Feast and served online.", "features"),
    "loom#3": ("The router streams the answer of the last step.", "serving"),
}
TEMPLATE = "CONTEXT:\n{context}\nQUESTION: {question}"


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, Any]]:
    store, broken = FakeVectorStore(DOCUMENTS), FakeVectorStore(DOCUMENTS, fail_embed=500)
    chat = FakeChat("llm:")
    with serving(store.app()) as store_url, serving(broken.app()) as broken_url, serving(chat.app()) as chat_url:
        yield {"store": store, "store_url": store_url, "broken_url": broken_url, "chat": chat, "chat_url": chat_url}


def router_config(fakes: dict[str, Any], **retrieve: Any) -> RouterConfig:
    store: FakeVectorStore = fakes["store"]
    unreachable = store.store("http://127.0.0.1:1")
    return RouterConfig.model_validate({
        "graphName": "ask",
        "nodes": {"root": {"routerType": "Sequence", "steps": [{
            "name": "answer", "serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard",
            "retrieve": {"featureView": "docs", "topK": 2, "promptTemplate": TEMPLATE, **retrieve},
        }]}},
        "services": {"llm": {"url": fakes["chat_url"], "modelName": "tiny-llama"}},
        "stores": {"docs": store.store(fakes["store_url"]), "broken": store.store(fakes["broken_url"]),
                   "gone": unreachable},
    })


@pytest.fixture()
def serve(fakes: dict[str, Any]) -> Iterator[Any]:
    servers: list[Any] = []

    def start(**retrieve: Any) -> str:
        server = serving(build_app(router_config(fakes, **retrieve)))
        servers.append(server)
        return server.__enter__()

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


ASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what does the router stream?"}]


def test_the_answer_is_given_from_the_nearest_documents_and_names_them(serve: Any, fakes: dict[str, Any]) -> None:
    url = serve()
    raw = client(url).chat.completions.with_raw_response.create(model="ask", messages=ASK)
    completion = raw.parse()
    sources = json.loads(raw.headers["loom-rag-sources"])
    assert [s["id"] for s in sources] == ["loom#3", "loom#1"]
    assert sources[0]["score"] > sources[1]["score"] > 0
    # The completion carries the same list (OpenAI's models keep unknown fields).
    assert (completion.model_extra or {})["loom_sources"] == sources
    # The LLM got the template with the documents and the question, in place of the last user message.
    sent, _ = fakes["chat"].requests[-1]
    assert sent["model"] == "tiny-llama" and sent["messages"][0] == ASK[0]
    prompt = sent["messages"][-1]["content"]
    assert prompt.startswith("CONTEXT:\n[1] (source: loom#3)\nThe router streams the answer of the last step.")
    assert prompt.endswith("QUESTION: what does the router stream?")
    assert completion.choices[0].message.content == "llm:" + prompt
    # The question was embedded by the view's embedding model.
    assert fakes["store"].embed_requests[-1] == {"model": "toy-embedder", "input": "what does the router stream?"}


def test_a_streamed_answer_names_its_sources_in_the_headers(serve: Any) -> None:
    url = serve()
    with client(url).chat.completions.with_streaming_response.create(model="ask", messages=ASK, stream=True) as raw:
        assert [s["id"] for s in json.loads(raw.headers["loom-rag-sources"])] == ["loom#3", "loom#1"]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert text.startswith("llm:CONTEXT:\n[1] (source: loom#3)")


def test_filters_and_threshold_choose_the_documents(serve: Any) -> None:
    url = serve(topK=4, filters=[{"field": "topic", "values": ["training", "features"]}])
    raw = client(url).chat.completions.with_raw_response.create(model="ask", messages=ASK)
    assert {s["id"] for s in json.loads(raw.headers["loom-rag-sources"])} == {"loom#0", "loom#2"}
    strict = serve(minScore=0.99)
    raw = client(strict).chat.completions.with_raw_response.create(model="ask", messages=ASK)
    assert json.loads(raw.headers["loom-rag-sources"]) == []
    metrics = httpx.get(f"{strict}/metrics").text
    assert 'loom_router_retrieval_empty_total{feature_view="docs",graph="ask",node="root",step="answer"} 1.0' in metrics
    assert 'loom_router_retrieval_duration_seconds_count{feature_view="docs"' in metrics


@pytest.mark.parametrize(("view", "cause"), [("broken", "answered 500: embedder down"), ("gone", "cannot reach")])
def test_a_failing_retrieval_fails_naming_the_step(serve: Any, view: str, cause: str) -> None:
    url = serve(featureView=view)
    with pytest.raises(openai.APIStatusError) as caught:
        client(url).chat.completions.create(model="ask", messages=ASK)
    assert caught.value.status_code == 502
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "retrieval_failed" and error["step"] == "answer"
    assert f"retrieval from FeatureView {view!r} failed" in error["message"] and cause in error["message"]
    metrics = httpx.get(f"{url}/metrics").text
    series = f'loom_router_retrieval_failures_total{{feature_view="{view}",graph="ask",node="root",outcome="failed"'
    assert series in metrics


def test_a_failing_retrieval_degrades_to_an_answer_without_context_when_configured(
    serve: Any, fakes: dict[str, Any]
) -> None:
    url = serve(featureView="broken", onFailure="AnswerWithoutContext")
    raw = client(url).chat.completions.with_raw_response.create(model="ask", messages=ASK)
    assert json.loads(raw.headers["loom-rag-sources"]) == []
    assert "embedder down" in raw.headers["loom-rag-degraded"]
    assert "(no documents could be retrieved)" in fakes["chat"].requests[-1][0]["messages"][-1]["content"]
    assert raw.parse().choices[0].message.content.startswith("llm:CONTEXT:\n(no documents")


def test_a_question_over_the_budget_is_refused_naming_the_limit(serve: Any, fakes: dict[str, Any]) -> None:
    url = serve(promptBudgetChars=200)
    embedded = len(fakes["store"].embed_requests)
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(model="ask", messages=[{"role": "user", "content": "why? " * 60}])
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "question_too_long"
    assert "budget of 200" in error["message"] and "step 'answer'" in error["message"]
    assert len(fakes["store"].embed_requests) == embedded  # refused before anything was embedded


def test_documents_over_the_budget_are_cut_or_refused(serve: Any) -> None:
    cut = serve(promptBudgetChars=100)
    raw = client(cut).chat.completions.with_raw_response.create(model="ask", messages=ASK)
    assert json.loads(raw.headers["loom-rag-sources"])[-1]["truncated"] is True
    refuse = serve(promptBudgetChars=100, onOverflow="Refuse")
    with pytest.raises(openai.BadRequestError) as caught:
        client(refuse).chat.completions.create(model="ask", messages=ASK)
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "context_too_long"


def test_retrieve_needs_an_openai_chat_step_and_a_known_store(fakes: dict[str, Any]) -> None:
    config = router_config(fakes).model_dump(by_alias=True)
    step = config["nodes"]["root"]["steps"][0]
    with pytest.raises(ValueError, match="retrieve applies to steps with protocol openai-chat"):
        RouterConfig.model_validate({**config, "nodes": {"root": {"routerType": "Sequence", "steps": [
            {**step, "protocol": None}]}}})
    with pytest.raises(ValueError, match="featureView 'nowhere' has no entry in stores"):
        RouterConfig.model_validate({**config, "nodes": {"root": {"routerType": "Sequence", "steps": [
            {**step, "retrieve": {**step["retrieve"], "featureView": "nowhere"}}]}}})
