"""The router's OpenAI chat protocol (steps with protocol openai-chat) against fake OpenAI services served by uvicorn
on 127.0.0.1, driven with the official `openai` client and httpx: a two-step Sequence chains the assistant message,
the last step streams through with [DONE], the caller's API key reaches every step, a Switch routes on the chat
request, and upstream errors come back OpenAI-shaped; plus the graph checks that refuse a misused protocol."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from loom.workloads.router.app import build_app
from loom.workloads.router.config import RouterConfig
from loom.workloads.router.testing import FakeChat, serving

KEY = "Bearer sk-graph-test"


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, tuple[FakeChat, str]]]:
    chats = {"draft": FakeChat("draft:"), "polish": FakeChat("polish:"), "limited": FakeChat("x", fail=429),
             "broken": FakeChat("x", fail=500), "cut": FakeChat("cut:", break_after=3)}
    with serving(chats["draft"].app()) as a, serving(chats["polish"].app()) as b, \
            serving(chats["limited"].app()) as c, serving(chats["broken"].app()) as d, \
            serving(chats["cut"].app()) as e:
        yield {"draft": (chats["draft"], a), "polish": (chats["polish"], b), "limited": (chats["limited"], c),
               "broken": (chats["broken"], d), "cut": (chats["cut"], e)}


def config(nodes: dict[str, Any], fakes: dict[str, tuple[FakeChat, str]]) -> RouterConfig:
    return RouterConfig.model_validate({
        "graphName": "writer",
        "nodes": nodes,
        "services": {name: {"url": url, "modelName": f"{name}-model"} for name, (_, url) in fakes.items()},
    })


def chat_step(service: str, **extra: Any) -> dict[str, Any]:
    return {"serviceName": service, "protocol": "openai-chat", "dependency": "Hard", **extra}


SEQUENCE = {"root": {"routerType": "Sequence", "steps": [
    chat_step("draft"), chat_step("polish", data="$response"),
]}}


@pytest.fixture(scope="module")
def router(fakes: dict[str, tuple[FakeChat, str]]) -> Iterator[str]:
    with serving(build_app(config(SEQUENCE, fakes))) as url:
        yield url


def client(router: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router}/v1", api_key=KEY.removeprefix("Bearer "), max_retries=0)


def test_two_step_sequence_chains_the_assistant_message(
    router: str, fakes: dict[str, tuple[FakeChat, str]]
) -> None:
    draft, polish = fakes["draft"][0], fakes["polish"][0]
    draft.requests.clear()
    polish.requests.clear()
    answer = client(router).chat.completions.create(
        model="writer", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        temperature=0.5, max_tokens=7,
    )
    assert answer.choices[0].message.content == "polish:draft:hi"
    (first, first_headers), (second, second_headers) = draft.requests[0], polish.requests[0]
    # Each step is called for its own served model; the first gets the caller's messages as they are.
    assert first["model"] == "draft-model" and first["stream"] is False
    assert first["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # The next step's input is the previous assistant message, as a user message; sampling fields carry over.
    assert second["model"] == "polish-model"
    assert second["messages"] == [{"role": "user", "content": "draft:hi"}]
    assert (second["temperature"], second["max_tokens"]) == (0.5, 7)
    # The caller's API key reaches every step.
    assert first_headers["authorization"] == KEY and second_headers["authorization"] == KEY


def test_streaming_runs_earlier_steps_whole_and_streams_the_last(
    router: str, fakes: dict[str, tuple[FakeChat, str]]
) -> None:
    draft, polish = fakes["draft"][0], fakes["polish"][0]
    draft.requests.clear()
    polish.requests.clear()
    stream = client(router).chat.completions.create(
        model="writer", messages=[{"role": "user", "content": "yo"}], stream=True,
        stream_options={"include_usage": True},
    )
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices]
    assert pieces == list("polish:draft:yo")  # one chunk per character, as the last step sent them
    assert draft.requests[0][0]["stream"] is False and "stream_options" not in draft.requests[0][0]
    assert polish.requests[0][0]["stream"] is True
    assert polish.requests[0][0]["stream_options"] == {"include_usage": True}
    with httpx.stream("POST", f"{router}/v1/chat/completions",
                      json={"model": "writer", "stream": True, "messages": [{"role": "user", "content": "z"}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert r.headers["loom-graph-steps"] == "root.draft=ok,root.polish=ok"


def test_models_lists_the_graph_and_other_models_are_not_found(router: str) -> None:
    assert [m.id for m in client(router).models.list()] == ["writer"]
    with pytest.raises(openai.NotFoundError) as caught:
        client(router).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_oip_endpoints_of_a_chat_graph_say_which_protocol_it_speaks(router: str) -> None:
    response = httpx.post(f"{router}/v2/models/writer/generate", json={"text_input": "x"})
    assert response.status_code == 404
    assert "POST /v1/chat/completions" in response.json()["error"]


def test_bad_chat_request_is_an_openai_400(router: str) -> None:
    response = httpx.post(f"{router}/v1/chat/completions", json={"model": "writer", "messages": []})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "bad_request")
    assert "messages" in error["message"]


@pytest.mark.parametrize(("service", "status", "kind"), [
    ("limited", 429, openai.RateLimitError), ("broken", 502, openai.InternalServerError),
])
def test_upstream_error_is_openai_shaped(
    fakes: dict[str, tuple[FakeChat, str]], service: str, status: int, kind: type[openai.APIStatusError]
) -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [chat_step("draft"), chat_step(service, data="$response")]}}
    with serving(build_app(config(nodes, fakes))) as url:
        with pytest.raises(kind) as caught:
            client(url).chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}])
        streamed = httpx.post(f"{url}/v1/chat/completions",
                              json={"model": "writer", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    assert caught.value.status_code == status
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "upstream_error"
    assert error["type"] == ("rate_limit_error" if status == 429 else "server_error")
    assert (error["step"], error["upstream_status"], error["upstream_message"]) == (service, 500 if status == 502
                                                                                   else 429, "x refused")
    # An error before the stream's first event is an HTTP error, not a 200 stream (OpenAI's way).
    assert streamed.status_code == status and streamed.json()["error"]["code"] == "upstream_error"
    if status == 429:
        assert caught.value.response.headers["retry-after"] == "7"


def stream_events(url: str) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions",
                      json={"model": "writer", "stream": True, "messages": [{"role": "user", "content": "ab"}]}) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_stream_broken_mid_way_ends_with_an_openai_error_event_and_done(
    fakes: dict[str, tuple[FakeChat, str]]
) -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [chat_step("draft"), chat_step("cut", data="$response")]}}
    with serving(build_app(config(nodes, fakes))) as url:
        events = stream_events(url)
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"]["content"] for e in events[:3]]
    assert texts == list("cut")  # what arrived before the break was passed on
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("stream_error", "server_error")
    assert events[-1] == "data: [DONE]"


def test_a_skipped_soft_last_step_streams_the_previous_answer_as_one_chunk(
    fakes: dict[str, tuple[FakeChat, str]]
) -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [
        chat_step("draft"), chat_step("broken", data="$response", dependency="Soft"),
    ]}}
    with serving(build_app(config(nodes, fakes))) as url:
        events = stream_events(url)
    assert len(events) == 2 and events[-1] == "data: [DONE]"
    chunk = json.loads(events[0].removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"]["content"] == "draft:ab"


def test_switch_routes_on_the_chat_request(fakes: dict[str, tuple[FakeChat, str]]) -> None:
    nodes = {"root": {"routerType": "Switch", "steps": [
        chat_step("polish", condition="request.messages[0].content.startsWith('polish')"),
        chat_step("draft"),
    ]}}
    with serving(build_app(config(nodes, fakes))) as url:
        chat = client(url).chat.completions
        polished = chat.create(model="writer", messages=[{"role": "user", "content": "polish me"}])
        drafted = chat.create(model="writer", messages=[{"role": "user", "content": "me"}])
    assert polished.choices[0].message.content == "polish:polish me"
    assert drafted.choices[0].message.content == "draft:me"


def refused(nodes: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as caught:
        RouterConfig.model_validate({
            "graphName": "g", "nodes": nodes,
            "services": {s: {"url": "http://s", "modelName": "m"} for s in ("a", "b")},
        })
    return str(caught.value)


def test_a_graph_speaks_one_protocol() -> None:
    message = refused({"root": {"routerType": "Sequence", "steps": [
        chat_step("a"), {"serviceName": "b", "data": "$response"},
    ]}})
    assert "one graph speaks one protocol" in message and "step 1 (b)" in message


def test_an_openai_chat_ensemble_is_refused() -> None:
    message = refused({"root": {"routerType": "Ensemble", "steps": [chat_step("a"), chat_step("b")]}})
    assert "an Ensemble has no combined OpenAI chat answer" in message


def test_a_condition_on_oip_fields_is_refused_in_a_chat_graph() -> None:
    message = refused({"root": {"routerType": "Switch", "steps": [
        chat_step("a", condition="request.inputs[0].data[0] > 0.5"), chat_step("b"),
    ]}})
    assert "condition reads 'inputs'" in message and "request.messages" in message


def test_protocol_on_a_node_step_is_refused() -> None:
    message = refused({
        "root": {"routerType": "Sequence", "steps": [{"nodeName": "inner", "protocol": "openai-chat"}]},
        "inner": {"routerType": "Sequence", "steps": [chat_step("a")]},
    })
    assert "protocol applies to serviceName steps" in message


def test_protocol_follows_the_steps() -> None:
    chat = RouterConfig.model_validate({
        "graphName": "g", "nodes": {"root": {"routerType": "Sequence", "steps": [chat_step("a")]}},
        "services": {"a": {"url": "http://s", "modelName": "m"}},
    })
    oip = RouterConfig.model_validate({
        "graphName": "g", "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}},
        "services": {"a": {"url": "http://s", "modelName": "m"}},
    })
    assert (chat.protocol, oip.protocol) == ("openai-chat", "oip-v2")
