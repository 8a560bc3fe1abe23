"""The front's byte relay of the engine's event stream (pure): what the client gets and the facts read on the way
(text begun, usage, the end), over streams as vLLM writes them (compact JSON, the usage in an event of its own)."""

from __future__ import annotations

import json
from typing import Any

from loom.workloads.llm.sse_relay import SseRelay, events


def event(doc: dict[str, Any] | str) -> bytes:
    text = doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def chat(content: str | None, model: str = "tiny", role: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": role} if role else {}
    if content is not None:
        delta["content"] = content
    return event({"id": "c1", "object": "chat.completion.chunk", "model": model,
                  "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def usage(prompt: int, completion: int, model: str = "tiny") -> bytes:
    return event({"id": "c1", "object": "chat.completion.chunk", "model": model, "choices": [],
                  "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}})


STREAM = chat("", role="assistant") + chat("He") + chat("llo") + usage(7, 2) + event("[DONE]")


def relay_all(relay: SseRelay, data: bytes, step: int) -> bytes:
    out = b"".join(relay.feed(data[i:i + step]) for i in range(0, len(data), step))
    return out + relay.end()


def test_with_usage_asked_the_bytes_pass_unchanged_and_the_usage_is_read() -> None:
    relay = SseRelay(keep_usage=True)
    assert relay.feed(STREAM) == STREAM
    assert relay.end() == b""
    assert relay.usage == (7, 2) and relay.done and relay.text_started


def test_without_usage_asked_its_event_is_dropped_and_still_read() -> None:
    relay = SseRelay(keep_usage=False)
    out = relay.feed(STREAM)
    assert out == chat("", role="assistant") + chat("He") + chat("llo") + event("[DONE]")
    assert relay.usage == (7, 2) and relay.done


def test_events_split_across_reads_wait_for_their_end_and_come_out_whole() -> None:
    for step in (1, 3, 17, 64):
        relay = SseRelay(keep_usage=False)
        assert relay_all(relay, STREAM, step) == chat("", role="assistant") + chat("He") + chat("llo") + event(
            "[DONE]")
        assert relay.usage == (7, 2) and relay.done
    relay = SseRelay(keep_usage=True)
    assert relay.feed(chat("He")[:10]) == b""  # nothing whole yet
    assert not relay.text_started


def test_text_begins_at_the_first_nonempty_content_or_completion_text() -> None:
    relay = SseRelay(keep_usage=True)
    relay.feed(chat("", role="assistant"))
    assert not relay.text_started  # the role event carries no text
    relay.feed(chat(None))
    assert not relay.text_started
    relay.feed(chat('"quoted" text'))  # an escaped quote first is still text
    assert relay.text_started
    completion = SseRelay(keep_usage=True)
    completion.feed(event({"choices": [{"index": 0, "text": ""}]}))
    assert not completion.text_started
    completion.feed(event({"choices": [{"index": 0, "text": " a"}]}))
    assert completion.text_started


def test_text_that_looks_like_a_key_is_not_taken_for_one() -> None:
    relay = SseRelay(keep_usage=True)
    relay.feed(chat("", role="assistant") + chat(None) + event({"choices": [{"delta": {"reasoning": '"content":"x'}}]}))
    assert not relay.text_started  # inside a string its quotes are escaped


def test_an_adapter_version_is_renamed_to_the_adapter_in_every_event() -> None:
    stream = chat("Hi", model="support@3f2a") + usage(4, 1, model="support@3f2a") + event("[DONE]")
    relay = SseRelay(keep_usage=True, engine_model="support@3f2a", client_model="support")
    out = relay.feed(stream)
    assert [doc["model"] for doc in events(out)] == ["support", "support"]
    assert relay.usage == (4, 1)
    spaced = SseRelay(keep_usage=True, engine_model="support@3f2a", client_model="support")
    assert events(spaced.feed(b'data: {"model": "support@3f2a", "choices": [{"text": "a"}]}\n\n')) == [
        {"model": "support", "choices": [{"text": "a"}]}]
    assert spaced.text_started
    same = SseRelay(keep_usage=True, engine_model="tiny", client_model=None)
    assert same.feed(STREAM) == STREAM


def test_usage_beside_choices_is_read_each_time_and_removed_when_not_asked() -> None:
    continuous = event({"model": "tiny", "choices": [{"index": 0, "delta": {"content": "a"}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    relay = SseRelay(keep_usage=False)
    out = relay.feed(continuous + usage(3, 2))
    assert events(out) == [{"model": "tiny", "choices": [{"index": 0, "delta": {"content": "a"}}]}]
    assert relay.usage == (3, 2)
    kept = SseRelay(keep_usage=True)
    assert kept.feed(continuous) == continuous and kept.usage == (3, 1)


def test_a_null_usage_is_no_usage() -> None:
    relay = SseRelay(keep_usage=False)
    nulled = event({"choices": [{"index": 0, "text": "a"}], "usage": None})
    assert relay.feed(nulled) == nulled and relay.usage == (0, 0)


def test_a_stream_cut_off_keeps_no_broken_event_and_is_not_done() -> None:
    relay = SseRelay(keep_usage=True)
    out = relay.feed(chat("He") + chat("llo")[:12])
    assert out == chat("He")
    assert relay.end() == b"" and not relay.done and relay.usage == (0, 0)
    unterminated = SseRelay(keep_usage=True)
    assert unterminated.feed(chat("He") + b"data: [DONE]") == chat("He")
    assert unterminated.end() == event("[DONE]") and unterminated.done


def test_events_reads_the_json_objects_of_a_block() -> None:
    assert events(STREAM) == [json.loads(e[6:]) for e in STREAM.split(b"\n\n") if e and b"[DONE]" not in e]
    assert events(b": keep-alive\n\n" + event("[DONE]")) == []
