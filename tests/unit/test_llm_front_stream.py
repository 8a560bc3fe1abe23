"""The front's token path over HTTP, in process: the real VllmEngine adapter and the front's routes in front of a
stand-in engine that writes its streams the way vLLM's OpenAI server does (compact JSON events, the usage in a
final event of its own, ``data: [DONE]``). The engine process the front starts is a program that only sleeps;
the stand-in answers on its port with the front's key (the real engine: tests/integration/test_llm_vllm.py).

Checked: the client gets the engine's events byte for byte (less the usage event it did not ask for), the usage
is charged to the caller's token budget and counted in the front's metrics with a time to first token, streams
reuse one pooled connection to the engine, and an engine that breaks off mid-stream ends the client's stream
with an OpenAI-shaped error and [DONE].
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from loom.workloads.llm.app import build_app
from loom.workloads.llm.config import LlmLimits, LlmServerConfig
from loom.workloads.router.testing import serving
from loom.workloads.server.config import AuthConfig

MODEL = "tiny"
KEY = {"authorization": "Bearer k1"}
WORDS = ["He", "llo", " there"]


def chunk(delta: dict[str, Any]) -> bytes:
    doc = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


USAGE = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[],'
         b'"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3}}\n\n')
TOKEN_EVENTS = chunk({"role": "assistant", "content": ""}) + b"".join(chunk({"content": w}) for w in WORDS)


class StandIn:
    """vLLM's OpenAI server as far as the front's stream path sees it; records bodies and client ports."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.ports: list[int] = []
        self.cut_off = threading.Event()  # a slow stream ended before its last event: its client went away

    async def slow_events(self) -> AsyncIterator[bytes]:
        """A token every 50 ms for 10 s: long enough that only a client leaving ends it early."""
        finished = False
        try:
            for _ in range(200):
                yield chunk({"content": "x"})
                await asyncio.sleep(0.05)
            finished = True
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.cut_off.set()

    def app(self) -> Starlette:
        async def health(_: Request) -> Response:
            return PlainTextResponse("")

        async def models(request: Request) -> Response:
            if not request.headers.get("authorization", "").startswith("Bearer "):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return JSONResponse({"data": [{"id": MODEL}]})

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.ports.append(request.client.port if request.client else 0)
            broken = body["messages"][0]["content"] == "break"
            if body["messages"][0]["content"] == "slow":
                return StreamingResponse(self.slow_events(), media_type="text/event-stream")

            async def events() -> AsyncIterator[bytes]:
                yield TOKEN_EVENTS[:40]  # an event split across writes
                yield TOKEN_EVENTS[40:]
                if broken:
                    raise RuntimeError("the engine broke off")
                if body.get("stream_options", {}).get("include_usage"):
                    yield USAGE
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                                 Route("/v1/chat/completions", chat, methods=["POST"])])


def front_config(tmp_path: Path, engine_url: str, limits: LlmLimits | None = None) -> LlmServerConfig:
    """The front over the stand-in engine at `engine_url`; the engine command it starts only sleeps."""
    program = tmp_path / "engine"
    program.write_text("#!/bin/sh\nexec sleep 600\n")
    program.chmod(0o755)
    return LlmServerConfig(model_name=MODEL, model_dir=str(tmp_path), engine_python=str(program),
                           engine_port=int(engine_url.rsplit(":", 1)[1]), engine_start_timeout_s=30,
                           auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"), limits=limits or LlmLimits())


def until_ready(client: TestClient | httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "the front never turned ready"
        time.sleep(0.05)


@pytest.fixture
def front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, StandIn]]:
    monkeypatch.setenv("LOOM_TEST_KEYS", "k1,k2")
    stand_in = StandIn()
    with serving(stand_in.app()) as engine_url:
        config = front_config(tmp_path, engine_url, LlmLimits(tokens_per_minute=10))
        with TestClient(build_app(config)) as client:
            until_ready(client)
            yield client, stand_in


def stream(client: TestClient, key: dict[str, str], content: str = "hi", **extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, **extra}
    with client.stream("POST", "/v1/chat/completions", headers=key, json=body) as answer:
        assert answer.status_code == 200
        return b"".join(answer.iter_bytes())


def samples(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("loom_llm_")}


def test_the_engine_events_reach_the_client_as_they_are_and_the_usage_is_charged(
        front: tuple[TestClient, StandIn]) -> None:
    client, stand_in = front
    asked = stream(client, KEY, stream_options={"include_usage": True})
    assert asked == TOKEN_EVENTS + USAGE + b"data: [DONE]\n\n"
    # The budget (10 tokens a minute) now holds the 8 this stream used: the next one fits, then it is spent.
    plain = stream(client, KEY)
    assert plain == TOKEN_EVENTS + b"data: [DONE]\n\n"  # no usage event: this client did not ask
    assert stand_in.bodies[-1]["stream_options"] == {"include_usage": True}  # the engine is always asked
    refused = client.post("/v1/chat/completions", headers=KEY,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    seen = samples(client)
    assert seen["loom_llm_generation_tokens_total"] == 6 and seen["loom_llm_prompt_tokens_total"] == 10
    assert seen["loom_llm_time_to_first_token_seconds_count"] == 2
    assert seen["loom_llm_time_per_output_token_seconds_count"] == 2
    assert len(set(stand_in.ports)) == 1  # both streams over one pooled connection to the engine


def test_an_engine_that_breaks_off_ends_the_stream_with_an_error_and_done(front: tuple[TestClient, StandIn]) -> None:
    client, _ = front
    got = stream(client, {"authorization": "Bearer k2"}, content="break")
    assert got.startswith(TOKEN_EVENTS)
    tail = got[len(TOKEN_EVENTS):].split(b"\n\n")
    error = json.loads(tail[0].removeprefix(b"data: "))["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "service_unavailable"
    assert tail[1:] == [b"data: [DONE]", b""]
    assert samples(client).get("loom_llm_generation_tokens_total", 0) == 0  # no usage came: nothing charged


def test_a_client_that_leaves_mid_stream_ends_the_engines_stream(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a real server (TestClient tells an app of a disconnect only after the response): the front stops
    reading the engine and closes its connection, so the engine stops generating for nobody."""
    monkeypatch.setenv("LOOM_TEST_KEYS", "k1")
    stand_in = StandIn()
    with serving(stand_in.app()) as engine_url:
        config = front_config(tmp_path, engine_url)
        with serving(build_app(config)) as front_url, httpx.Client(base_url=front_url, timeout=30) as client:
            until_ready(client)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "slow"}], "stream": True}
            with client.stream("POST", "/v1/chat/completions", headers=KEY, json=body) as answer:
                assert answer.status_code == 200
                first = next(answer.iter_bytes())
                assert first.startswith(b"data: ")
            # The client has closed its connection after one event of 200.
            assert stand_in.cut_off.wait(timeout=8), "the engine's stream went on after its client left"
