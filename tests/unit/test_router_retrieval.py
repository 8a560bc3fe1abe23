"""The retrieval step over a Retriever (retrieval.py), without HTTP: a retrieval that outlasts its timeout fails with
the timeout named, or degrades when configured; an answer that is not Feast's is a failure like an unreachable store;
what was used is reported."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from loom.workloads.router.retrieval import Retrieval, RetrievalFailed, RetrievalUnavailable, augment
from loom.workloads.router.retrieval_config import RetrieveConfig, VectorStoreConfig

STORE = VectorStoreConfig.model_validate({
    "searchUrl": "http://feast/search", "featureRefs": ["docs:text"], "textField": "text",
    "embedding": {"url": "http://embedder/v1/embeddings", "modelName": "e"},
})
REQUEST = {"model": "g", "messages": [{"role": "user", "content": "why?"}]}


class Scripted:
    def __init__(self, answer: Any = None, hang: bool = False, fail: bool = False):
        self.answer, self.hang, self.fail = answer, hang, fail
        self.asked: list[int] = []

    async def embed(self, store: VectorStoreConfig, text: str, headers: Mapping[str, str]) -> list[float]:
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            raise RetrievalUnavailable("cannot reach the embedding service")
        return [1.0, 0.0]

    async def search(
        self, store: VectorStoreConfig, vector: list[float], top_k: int, headers: Mapping[str, str]
    ) -> Any:
        self.asked.append(top_k)
        return self.answer


def run(retriever: Scripted, timeout_s: float = 5.0, **spec: Any) -> Any:
    config = RetrieveConfig(feature_view="docs", prompt_template="C:{context} Q:{question}", **spec)
    return asyncio.run(augment(REQUEST, config, STORE, retriever, {}, timeout_s))


FEAST = {"metadata": {"feature_names": ["text", "distance", "doc_id"]},
         "results": [{"values": ["b text", "a text"]}, {"values": [0.4, 0.1]}, {"values": ["b", "a"]}]}


def test_the_documents_used_are_reported() -> None:
    augmented = run(Scripted(FEAST), topK=1)
    assert augmented.retrieval.returned == 2
    assert [(s.id, round(s.score, 3)) for s in augmented.retrieval.sources] == [("a", 0.9)]
    assert augmented.request["messages"][0]["content"] == "C:[1] (source: a)\na text Q:why?"


def test_a_retrieval_over_its_timeout_fails_naming_it_or_degrades() -> None:
    with pytest.raises(RetrievalFailed) as caught:
        run(Scripted(hang=True), timeout_s=0.05)
    assert caught.value.timed_out and "longer than 50 ms" in caught.value.message
    degraded = run(Scripted(hang=True), timeout_s=0.05, on_failure="AnswerWithoutContext")
    assert degraded.retrieval == Retrieval(degraded="retrieval took longer than 50 ms")
    assert "(no documents could be retrieved)" in degraded.request["messages"][0]["content"]


@pytest.mark.parametrize("retriever", [Scripted({"results": "nonsense"}), Scripted(fail=True)])
def test_a_broken_answer_or_an_unreachable_service_is_a_failure(retriever: Scripted) -> None:
    with pytest.raises(RetrievalFailed) as caught:
        run(retriever)
    assert not caught.value.timed_out
    assert run(retriever, on_failure="AnswerWithoutContext").retrieval.sources == []


def test_filters_ask_the_store_for_more() -> None:
    retriever = Scripted(FEAST)
    run(retriever, topK=3, filters=[{"field": "doc_id", "values": ["a"]}])
    assert retriever.asked == [12]
