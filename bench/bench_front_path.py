"""What the vllm front's request path costs per request before the engine sees it, step by step, in process (numbers
printed, nothing asserted).

A chat request of vLLM's benchmark client's shape (random dataset, 64 tokens of prompt; the bench_front.py load)
goes through the front's real ASGI app (build_app: the drain, the key and budget guard, the body limit, routing,
the OpenAI checks) to a stand-in engine whose stream answers at once with a short stream of vLLM's bytes, so the
front's own Python is all that is timed; no sockets (bench_front.py measures the hop over the loopback). Beside
the whole, each step alone with timeit: the key check, the token budget check, the body's checks and the engine's
copy of it, the engine body's JSON, the relay of one event, the metrics of one finished request; what each
further token event of a stream costs the front's Python (its socket I/O excluded); and the whole request with
Starlette's StreamingResponse in place of the front's SseResponse (sse_response.py).

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_front_path.py [--requests 2000]

Run it in the vLLM environment (the front's, with uvloop) or Loom's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import timeit
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Mapping
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message

from loom.workloads.llm import app as app_module
from loom.workloads.llm.app import build_app
from loom.workloads.llm.budget import TokenBudget
from loom.workloads.llm.config import LlmLimits, LlmServerConfig
from loom.workloads.llm.metrics import LlmMetrics
from loom.workloads.llm.openai_protocol import parse_request
from loom.workloads.llm.sse_relay import SseRelay
from loom.workloads.server.callers import caller_of
from loom.workloads.server.config import AuthConfig
from loom.workloads.server.flow import ApiKeys

MODEL = "llama"
KEY = "bench-front-key"
# 64 random tokens' worth of text, as vLLM's random dataset sends them.
PROMPT = " ".join(f"w{i:03d}x" for i in range(64))
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 32,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
HEADERS = [(b"host", b"127.0.0.1:8080"), (b"user-agent", b"aiohttp"), (b"accept", b"*/*"),
           (b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode()),
           (b"content-length", str(len(BODY)).encode())]
EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"llama","choices":[{"index":0,'
         b'"delta":{"content":" w001x"},"logprobs":null,"finish_reason":null}]}\n\n')
USAGE = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"llama","choices":[],'
         b'"usage":{"prompt_tokens":64,"total_tokens":96,"completion_tokens":32}}\n\n')


class StandInEngine:
    """The VllmEngine's stream as the routes use it, answering at once with ``events`` token events (one read each),
    the usage, [DONE]."""

    running = True

    def __init__(self, events: int) -> None:
        self.events = events

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, AsyncIterator[bytes], bytes]]:
        json.dumps(body)  # what aiohttp's json= does with it

        async def data() -> AsyncIterator[bytes]:
            for _ in range(self.events):
                yield EVENT
            yield USAGE + b"data: [DONE]\n\n"

        yield 200, data(), b""


def config(budgets: bool) -> LlmServerConfig:
    """bench_front.py's front (keys on), with both per-key budgets when ``budgets``."""
    limits = LlmLimits(tokens_per_minute=10**9, requests_per_minute=10**6) if budgets else LlmLimits()
    return LlmServerConfig(model_name=MODEL, model_dir="/nonexistent", auth=AuthConfig(api_keys_env="LOOM_BENCH_KEYS"),
                           limits=limits)


async def whole_requests(count: int, budgets: bool, events: int = 1) -> float:
    """Seconds per request through the app, from the request's first ASGI message to its last byte sent (the least
    of 5 batches' means)."""
    app = build_app(config(budgets), engine=StandInEngine(events))  # type: ignore[arg-type]
    app.state.routes.ready = True
    scope: dict[str, Any] = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                             "query_string": b"", "root_path": "", "headers": HEADERS,
                             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}

    async def one() -> None:
        sent: list[Message] = []
        messages = iter([{"type": "http.request", "body": BODY, "more_body": False}])
        answered = asyncio.Event()

        async def receive() -> Message:
            # After the body, as uvicorn does: nothing until the client leaves or the response is complete.
            message = next(messages, None)
            if message is None:
                await answered.wait()
                message = {"type": "http.disconnect"}
            return message

        async def send(message: Message) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered.set()

        await app({**scope, "state": {}}, receive, send)
        if sent[0]["status"] != 200 or not answered.is_set() or b"[DONE]" not in sent[-2]["body"]:
            raise RuntimeError(f"the front's answer was not a whole stream: {sent}")

    for _ in range(50):  # warm-up
        await one()
    batches = []
    for _ in range(5):  # the least of 5 batches, as timeit's repeat: a shared machine's load only adds time
        started = time.perf_counter()
        for _ in range(max(1, count // 5)):
            await one()
        batches.append((time.perf_counter() - started) / max(1, count // 5))
    return min(batches)


@contextlib.contextmanager
def starlettes_streaming_response() -> Iterator[None]:
    """The front's routes answering with Starlette's StreamingResponse (its anyio task group) instead of SseResponse."""
    saved = app_module.SseResponse

    def streaming(content: AsyncIterable[bytes], headers: Mapping[str, str] | None = None) -> StreamingResponse:
        return StreamingResponse(content, media_type="text/event-stream", headers=headers)

    app_module.SseResponse = streaming  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        app_module.SseResponse = saved  # type: ignore[misc]


def per_call(statement: Callable[[], object], number: int = 20000) -> float:
    return min(timeit.repeat(statement, number=number, repeat=5)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    os.environ["LOOM_BENCH_KEYS"] = KEY
    keys = ApiKeys(AuthConfig(api_keys_env="LOOM_BENCH_KEYS"))
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": HEADERS}
    budget = TokenBudget(10**9)
    for at in range(5000):  # a busy key: 5,000 requests in its window
        budget.charge("key", 96, at / 100)
    parsed = parse_request("chat", BODY, MODEL, 4096)
    metrics = LlmMetrics(MODEL)

    def relay() -> None:
        SseRelay(True, MODEL, None).feed(EVENT)

    steps = [
        ("API key check (caller_of)", lambda: caller_of(scope, keys)),
        ("token budget check", lambda: budget.check("key", 50.0)),
        ("body checks + engine body (parse_request)", lambda: parse_request("chat", BODY, MODEL, 4096)),
        ("engine body to JSON (the POST's json=)", lambda: json.dumps(parsed.engine_body)),
        ("relay of one event (new SseRelay + feed)", relay),
        ("metrics of one finished request", lambda: metrics.finished(0.0, 0.01, 0.3, 64, 32)),
        ("metrics: one answer counted", lambda: metrics.answered("chat_completions", 200)),
    ]
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        bare = runner.run(whole_requests(args.requests, budgets=False))
        with starlettes_streaming_response():
            before = runner.run(whole_requests(args.requests, budgets=False))
        budgeted = runner.run(whole_requests(args.requests, budgets=True))
        longer = runner.run(whole_requests(args.requests // 4, budgets=False, events=33))
    print(f"== the front's request path, in process ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    print(f"{bare * 1e6:8.1f} µs  a whole streamed request through the app (ASGI in to last byte out, no sockets), "
          "keys on")
    print(f"{before * 1e6:8.1f} µs  the same with Starlette's StreamingResponse (the front's until sse_response.py)")
    print(f"{budgeted * 1e6:8.1f} µs  the same with a request and a token budget per key")
    print(f"{(longer - bare) / 32 * 1e6:8.1f} µs  each further token event of a stream (33 events less 1, over 32)")
    for name, statement in steps:
        print(f"{per_call(statement) * 1e6:8.1f} µs  {name}")


if __name__ == "__main__":
    main()
