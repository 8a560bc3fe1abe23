"""The retrieval step's pure parts: reading Feast's search answer, scoring and selecting documents, the prompt
template and its budget, and how the sources are written into a response."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loom.workloads.router.prompt import (
    PromptError,
    build_prompt,
    fill,
    question_of,
    with_prompt,
)
from loom.workloads.router.retrieval_config import MetadataFilter, RetrieveConfig
from loom.workloads.router.sources import (
    Document,
    Source,
    StoreAnswerError,
    candidates,
    parse_search,
    score_of,
    select,
    sources_header,
    with_sources,
)

REFS = ["docs:text", "docs:topic"]


def answer(rows: list[tuple[str, str, str, float]]) -> dict[str, Any]:
    """Feast's column-wise form: requested features, distance, then the join key."""
    names = ["text", "topic", "distance", "doc_id"]
    columns = [[r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows], [r[0] for r in rows]]
    return {"metadata": {"feature_names": names}, "results": [{"values": c} for c in columns]}


def doc(doc_id: str, text: str = "t", distance: float = 0.1, topic: str = "a") -> Document:
    return Document(doc_id, text, distance, score_of(distance, "cosine"), {"topic": topic, "doc_id": doc_id})


def test_the_answer_is_read_nearest_first_with_the_join_key_as_id() -> None:
    # Rows come in join-key order (the store's), not by distance.
    documents = parse_search(
        answer([("d1", "far", "a", 0.7), ("d2", "near", "b", 0.05), ("d3", "mid", "a", 0.3)]), REFS, "text", "cosine"
    )
    assert [(d.id, d.text) for d in documents] == [("d2", "near"), ("d3", "mid"), ("d1", "far")]
    assert documents[0].score == pytest.approx(0.95)
    assert documents[0].metadata == {"topic": "b", "doc_id": "d2"}


def test_prefixed_feature_names_and_an_empty_store_are_read() -> None:
    prefixed = answer([("d1", "x", "a", 0.2)])
    prefixed["metadata"]["feature_names"] = ["docs__text", "docs__topic", "distance", "doc_id"]
    assert [d.id for d in parse_search(prefixed, REFS, "text", "cosine")] == ["d1"]
    assert parse_search(answer([]), REFS, "text", "cosine") == []


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ([], "not a JSON object"),
        ({"results": []}, "feature_names"),
        ({"metadata": {"feature_names": ["text", "doc_id"]}, "results": [{"values": []}, {"values": []}]}, "distance"),
        ({"metadata": {"feature_names": ["topic", "distance"]}, "results": [{"values": []}, {"values": []}]}, "'text'"),
        ({"metadata": {"feature_names": ["text", "distance"]}, "results": [{"values": ["a"]}, {"values": []}]},
         "different lengths"),
    ],
)
def test_an_answer_that_is_not_feasts_is_refused(broken: Any, message: str) -> None:
    with pytest.raises(StoreAnswerError, match=message):
        parse_search(broken, REFS, "text", "cosine")


def test_scores() -> None:
    assert score_of(0.25, "cosine") == pytest.approx(0.75)
    assert score_of(0.0, "L2") == 1.0
    assert score_of(3.0, "l2") == pytest.approx(0.25)


def test_select_applies_threshold_filters_and_top_k() -> None:
    documents = [doc("a", distance=0.1, topic="x"), doc("b", distance=0.2, topic="y"), doc("c", distance=0.6),
                 doc("d", distance=0.3, topic="x")]
    assert [d.id for d in select(documents, 2, None, [])] == ["a", "b"]
    assert [d.id for d in select(documents, 9, 0.75, [])] == ["a", "b"]
    only_x = [MetadataFilter(field="topic", values=["x"])]
    assert [d.id for d in select(documents, 9, None, only_x)] == ["a", "d"]
    not_x = [MetadataFilter(field="topic", operator="NotIn", values=["x"])]
    assert [d.id for d in select(documents, 9, None, not_x)] == ["b", "c"]
    # A filter on a feature the documents lack keeps none (In) and all (NotIn).
    assert select(documents, 9, None, [MetadataFilter(field="lang", values=["en"])]) == []
    assert len(select(documents, 9, None, [MetadataFilter(field="lang", operator="NotIn", values=["en"])])) == 4
    # Filters are applied here: the store is asked for more.
    assert (candidates(4, []), candidates(4, only_x), candidates(50, only_x)) == (4, 16, 200)


def test_the_template_is_filled_once_and_nothing_else_is_interpreted() -> None:
    template = "{x} {0} {question.__class__} C={context} Q={question}"
    # A question naming a placeholder stays text; other braces stay as written.
    assert fill(template, "what is {context}?", "docs") == "{x} {0} {question.__class__} C=docs Q=what is {context}?"


def test_the_question_is_the_last_user_message() -> None:
    request = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
                            {"role": "assistant", "content": "a"},
                            {"role": "user", "content": [{"type": "text", "text": "second"},
                                                         {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert question_of(request) == "second"
    rewritten = with_prompt(request, "PROMPT")
    assert rewritten["messages"][:3] == request["messages"][:3]
    assert rewritten["messages"][3]["content"] == "PROMPT"
    for bad in ({"messages": [{"role": "system", "content": "s"}]}, {"messages": [{"role": "user", "content": " "}]}):
        with pytest.raises(PromptError) as caught:
            question_of(bad)
        assert caught.value.code == "no_question"


def test_documents_fill_the_budget_nearest_first() -> None:
    template = "C:{context}\nQ:{question}"
    documents = [doc("a", "alpha " * 5), doc("b", "beta " * 5), doc("c", "gamma " * 50)]
    prompt = build_prompt(template, "why?", documents, 10_000, "TruncateDocuments")
    assert [s.id for s in prompt.sources] == ["a", "b", "c"]
    assert "[1] (source: a)\nalpha" in prompt.text and "[3] (source: c)" in prompt.text
    # A small budget: the first whole, the second cut, the third left out.
    small = build_prompt(template, "why?", documents, 90, "TruncateDocuments")
    assert [(s.id, s.truncated) for s in small.sources] == [("a", False), ("b", True)]
    assert len(small.text) <= 90
    assert "gamma" not in small.text


def test_overflow_refused_when_configured_and_a_long_question_always() -> None:
    documents = [doc("a", "alpha " * 50)]
    with pytest.raises(PromptError) as caught:
        build_prompt("{context}{question}", "q", documents, 100, "Refuse")
    assert caught.value.code == "context_too_long" and "budget of 100" in caught.value.message
    with pytest.raises(PromptError) as long_question:
        build_prompt("{context}{question}", "q" * 101, [], 100, "TruncateDocuments")
    assert long_question.value.code == "question_too_long"
    assert "budget of 100" in long_question.value.message and "promptBudgetChars" in long_question.value.message


def test_the_template_must_hold_both_placeholders() -> None:
    with pytest.raises(ValueError, match="must contain \\{context\\}"):
        RetrieveConfig(feature_view="docs", prompt_template="Q: {question}")
    assert RetrieveConfig(feature_view="docs").top_k == 4


def test_sources_in_a_header_and_in_the_completion() -> None:
    sources = [Source("d1#0", 0.91234567), Source("d\u00e9", 0.5, truncated=True)]
    header = sources_header(sources)
    assert header.isascii()
    assert json.loads(header) == [{"id": "d1#0", "score": 0.912346}, {"id": "d\u00e9", "score": 0.5, "truncated": True}]
    body = with_sources(b'{"id":"c","choices":[]}', sources)
    assert json.loads(body)["loom_sources"][0] == {"id": "d1#0", "score": 0.912346}
    assert with_sources(b"not json", sources) == b"not json"
