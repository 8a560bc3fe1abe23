"""The OpenAI request checks and error mapping of the vllm runtime's front (pure code, no engine)."""

from __future__ import annotations

import json

import pytest

from loom.workloads.llm.openai_protocol import (
    OpenAIError,
    chunk_text,
    completion_to_generate,
    engine_error,
    generate_to_completion,
    parse_request,
    sse,
    usage_tokens,
)
from loom.workloads.llm.sse_relay import events
from loom.workloads.server.protocol import GenerateRequest


def parse(doc: dict[str, object], kind: str = "chat") -> object:
    return parse_request(kind, json.dumps(doc).encode(), "tiny", 64)  # type: ignore[arg-type]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_request_goes_to_the_engine_with_its_fields_and_a_max_tokens() -> None:
    parsed = parse({**CHAT, "temperature": 0.5, "top_p": 0.9, "seed": 7, "n": 2, "stop": ["\n"], "top_k": 5})
    assert parsed.kind == "chat" and not parsed.stream and parsed.n == 2
    assert parsed.max_tokens == 16  # the front's default, sent explicitly so the budget and the engine agree
    body = parsed.engine_body
    assert body["max_tokens"] == 16 and body["top_k"] == 5 and body["seed"] == 7 and body["stop"] == ["\n"]


def test_max_completion_tokens_is_sent_as_max_tokens() -> None:
    parsed = parse({**CHAT, "max_completion_tokens": 9})
    assert parsed.max_tokens == 9
    assert parsed.engine_body["max_tokens"] == 9 and "max_completion_tokens" not in parsed.engine_body


def test_a_stream_always_asks_the_engine_for_usage_and_remembers_whether_the_client_did() -> None:
    plain = parse({**CHAT, "stream": True})
    assert plain.stream and not plain.include_usage
    assert plain.engine_body["stream_options"] == {"include_usage": True}
    asked = parse({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.include_usage


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 65}, "max_tokens"),  # above the service's max_tokens limit
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"model": None}, "model"),
    ],
)
def test_bad_fields_are_400_naming_the_field(change: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse({**CHAT, **change})
    assert caught.value.status == 400 and caught.value.param == param
    body = caught.value.body()["error"]
    assert body["type"] == "invalid_request_error" and body["message"]


def test_another_model_is_404_model_not_found() -> None:
    with pytest.raises(OpenAIError) as caught:
        parse({**CHAT, "model": "gpt-4"})
    assert caught.value.status == 404 and caught.value.code == "model_not_found"


@pytest.mark.parametrize("body", [b"{", b"[1]", b"\xff"])
def test_a_body_that_is_not_a_json_object_is_400(body: bytes) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request("completion", body, "tiny", 64)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3]])
def test_completion_prompts_of_every_openai_form_are_accepted(prompt: object) -> None:
    assert parse({"model": "tiny", "prompt": prompt}, "completion").engine_body["prompt"] == prompt


@pytest.mark.parametrize("prompt", [None, [], [1, "a"], {"a": 1}, [True]])
def test_other_prompts_are_refused(prompt: object) -> None:
    with pytest.raises(OpenAIError):
        parse({"model": "tiny", "prompt": prompt}, "completion")


def test_engine_errors_keep_status_message_and_code_in_both_vllm_shapes() -> None:
    nested = engine_error(400, json.dumps({"error": {"message": "too long", "type": "BadRequestError",
                                                     "param": "messages", "code": "context_length_exceeded"}}).encode())
    assert (nested.status, nested.message, nested.code, nested.param) == (
        400, "too long", "context_length_exceeded", "messages")
    assert nested.body()["error"]["type"] == "invalid_request_error"
    flat = engine_error(400, json.dumps({"object": "error", "message": "bad", "code": 400}).encode())
    assert (flat.status, flat.message, flat.code) == (400, "bad", None)
    garbage = engine_error(500, b"<html>")
    assert garbage.status == 500 and garbage.body()["error"]["type"] == "server_error"
    assert engine_error(200, b"{}").status == 502  # an engine that "succeeds" with an error is a bad gateway


def test_sse_framing_and_parsing_round_trip() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "He"}}]}
    line = sse(chunk).decode()
    assert line.endswith("\n\n") and line.startswith("data: ")
    assert events(sse(chunk)) == [chunk]
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert events(sse("[DONE]") + b": keep-alive\n\n" + sse("[1]")) == []


def test_chunk_text_and_usage_of_completions_and_chats() -> None:
    assert chunk_text({"choices": [{"text": "a"}, {"text": "b"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert usage_tokens({"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}) == (3, 4)
    assert usage_tokens({"usage": None}) == (0, 0)


def test_the_generate_extension_maps_onto_a_completion_and_back() -> None:
    body = json.loads(generate_to_completion(GenerateRequest("Tom", {"max_new_tokens": 5, "temperature": 0}, "r1"),
                                             "tiny", stream=True))
    assert body == {"model": "tiny", "prompt": "Tom", "stream": True, "max_tokens": 5, "temperature": 0}
    answer = completion_to_generate({"choices": [{"text": " said"}]}, "tiny", "r1").to_dict()
    assert answer == {"model_name": "tiny", "model_version": None, "text_output": " said", "id": "r1"}
