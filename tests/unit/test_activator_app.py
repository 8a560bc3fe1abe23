"""The activator's HTTP side end to end on 127.0.0.1: a real uvicorn serving it, a real aiohttp model server
behind it, and a fake waker standing for the API server (which the e2e test covers)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvicorn
from aiohttp import test_utils, web
from prometheus_client import generate_latest

from loom.workloads.activator import hold
from loom.workloads.activator.app import build_admin_app, build_app
from loom.workloads.activator.config import ActivatorConfig
from loom.workloads.activator.hold import Holder
from loom.workloads.activator.metrics import ActivatorMetrics
from loom.workloads.activator.proxy import Upstream
from loom.workloads.activator.targets import Targets

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeWaker:
    """Counts wakes; `then` is what the cluster does after the first one (e.g. a replica becomes Ready)."""

    def __init__(self, then: Callable[[], None] | None = None) -> None:
        self.calls = 0
        self.then = then

    async def wake(self) -> bool:
        self.calls += 1
        if self.calls == 1 and self.then is not None:
            asyncio.get_running_loop().call_later(0.2, self.then)
            return True
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Running:
    def __init__(self, url: str, targets: Targets, metrics: ActivatorMetrics, waker: FakeWaker) -> None:
        self.url, self.targets, self.metrics, self.waker = url, targets, metrics, waker

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {"service": "ml/chat", **labels})
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def activator(
    waker: FakeWaker, targets: Targets, **overrides: float | int
) -> AsyncIterator[Running]:
    port = free_port()
    cfg = ActivatorConfig.model_validate(
        {"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"}, "port": port, "retry_after_seconds": 3,
         **overrides}
    )  # fmt: skip
    metrics = ActivatorMetrics("ml/chat")
    holder = Holder(targets, waker, metrics, max_held=cfg.max_held, max_held_bytes=cfg.max_held_bytes)
    server = uvicorn.Server(uvicorn.Config(build_app(cfg, holder, Upstream(), metrics), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{port}", targets, metrics, waker)
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def model(handler: Handler) -> AsyncIterator[str]:
    """A real model server on 127.0.0.1 answering every path; yields its `host:port` endpoint."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with test_utils.TestServer(app, host="127.0.0.1") as server:
        yield f"127.0.0.1:{server.port}"


async def echo(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    auth = request.headers.get("authorization")
    return web.json_response({"path": request.path_qs, "method": request.method, "body": body.decode(), "auth": auth})


async def test_a_request_at_zero_is_held_wakes_the_service_and_is_forwarded_once_a_replica_is_ready() -> None:
    async with model(echo) as endpoint:
        targets = Targets()
        waker = FakeWaker(then=lambda: targets.set([endpoint]))
        async with activator(waker, targets) as act, httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(
                f"{act.url}/v2/models/chat/generate?x=%2F1", content=b'{"text_input":"hi"}',
                headers={"authorization": "Bearer k"}, timeout=10,
            )  # fmt: skip
            assert response.status_code == 200, response.text
            assert response.json() == {
                "path": "/v2/models/chat/generate?x=%2F1", "method": "POST", "body": '{"text_input":"hi"}',
                "auth": "Bearer k",
            }  # fmt: skip
            assert waker.calls == 1
            assert act.sample("loom_activator_wakes_total") == 1
            assert act.sample("loom_activator_requests_total", outcome="held_forwarded") == 1
            assert act.sample("loom_activator_wake_duration_seconds_count") == 1
            assert act.sample("loom_activator_held_requests") == 0
            # With a replica Ready, the next request goes straight on: no hold, no wake.
            again = await client.get(f"{act.url}/v2/health/ready", timeout=10)
            assert again.status_code == 200 and again.json()["method"] == "GET"
            assert (waker.calls, act.sample("loom_activator_requests_total", outcome="forwarded")) == (1, 1)


async def test_past_the_bound_the_answer_is_503_with_retry_after() -> None:
    waker = FakeWaker()  # nothing ever becomes ready
    async with activator(waker, Targets(), timeout_seconds=0.5) as act, httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(f"{act.url}/v2/models/chat/infer", content=b"{}", timeout=10)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    assert response.json()["code"] == "activator_timeout"
    assert waker.calls >= 1  # it did try to wake the service
    assert act.sample("loom_activator_requests_total", outcome="timeout") == 1


async def test_beyond_the_cap_on_held_requests_the_answer_is_503_at_once() -> None:
    waker = FakeWaker()
    async with activator(waker, Targets(), max_held=1, timeout_seconds=30) as act:
        async with httpx.AsyncClient(trust_env=False) as client:
            first = asyncio.create_task(client.post(f"{act.url}/a", content=b"1", timeout=60))
            while act.sample("loom_activator_held_requests") < 1:
                await asyncio.sleep(0.01)
            second = await client.post(f"{act.url}/b", content=b"2", timeout=10)
            assert second.status_code == 503
            assert second.json()["code"] == "activator_overloaded"
            assert second.headers["retry-after"] == "3"
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        # The caller of the first one left: it is no longer held.
        for _ in range(200):
            if act.sample("loom_activator_held_requests") == 0:
                break
            await asyncio.sleep(0.01)
        assert act.sample("loom_activator_held_requests") == 0
        assert act.sample("loom_activator_requests_total", outcome="overloaded") == 1


async def test_a_body_over_the_byte_cap_is_refused_with_413_declared_or_streamed() -> None:
    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(4):
            yield b"x" * 1024

    async with activator(FakeWaker(), Targets(), max_held_bytes=2048) as act, httpx.AsyncClient(trust_env=False) as c:
        declared = await c.post(f"{act.url}/v2/models/chat/infer", content=b"x" * 4096, timeout=10)
        streamed = await c.post(f"{act.url}/v2/models/chat/infer", content=chunked(), timeout=10)
    assert (declared.status_code, streamed.status_code) == (413, 413)
    assert act.sample("loom_activator_requests_total", outcome="too_large") == 2


async def test_a_stream_is_relayed_event_by_event_not_buffered() -> None:
    release = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text_output":"a"}\n\n')
        await release.wait()  # the rest only once the client saw the first event
        await response.write(b'data: {"text_output":"b"}\n\n')
        await response.write_eof()
        return response

    async with model(sse) as endpoint:
        targets = Targets()
        targets.set([endpoint])
        url = "/v2/models/chat/generate_stream"
        async with (
            activator(FakeWaker(), targets) as act,
            httpx.AsyncClient(trust_env=False) as client,
            client.stream("POST", f"{act.url}{url}", content=b"{}", timeout=10) as response,
        ):
            assert response.headers["content-type"] == "text/event-stream"
            chunks = response.aiter_bytes()
            first = await asyncio.wait_for(chunks.__anext__(), timeout=5)
            assert first == b'data: {"text_output":"a"}\n\n'
            release.set()
            rest = b"".join([chunk async for chunk in chunks])
    assert rest == b'data: {"text_output":"b"}\n\n'


async def test_a_replica_refusing_connections_is_skipped_within_the_bound() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    async with model(echo) as endpoint:
        targets = Targets()
        targets.set([dead])
        waker = FakeWaker(then=lambda: targets.set([endpoint]))
        async with activator(waker, targets) as act, httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(f"{act.url}/x", content=b"kept", timeout=10)
    assert response.status_code == 200
    assert response.json()["body"] == "kept"


async def test_admin_app_serves_health_and_metrics() -> None:
    metrics = ActivatorMetrics("ml/chat")
    ready = {"value": False}
    app = build_admin_app(metrics, lambda: ready["value"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as client:
        assert (await client.get("/healthz")).status_code == 503
        ready["value"] = True
        assert (await client.get("/healthz")).status_code == 200
        text = (await client.get("/metrics")).text
    assert 'loom_activator_held_requests{service="ml/chat"} 0.0' in text
    assert b"loom_activator_wakes_total" in generate_latest(metrics.registry)


async def test_a_wake_refused_by_the_api_is_asked_again_while_requests_are_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hold, "WAKE_RETRY_S", 0.05)

    class FlakyWaker(FakeWaker):
        async def wake(self) -> bool:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("the API server is unreachable")
            if self.calls == 2 and self.then is not None:
                self.then()
                return True
            return False

    async with model(echo) as endpoint:
        targets = Targets()
        waker = FlakyWaker(then=lambda: targets.set([endpoint]))
        async with activator(waker, targets) as act, httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(f"{act.url}/x", content=b"held", timeout=10)
    assert response.status_code == 200 and response.json()["body"] == "held"
    assert waker.calls == 2
    assert act.sample("loom_activator_wakes_total") == 1
