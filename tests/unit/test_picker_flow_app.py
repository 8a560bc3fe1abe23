"""Flow control through the picker's HTTP side on 127.0.0.1: a real uvicorn serving the picker (its decider with
the gate, as __main__ builds it) and a real aiohttp replica that holds each request until the test lets it go, so
what is in flight, waiting and shed is seen exactly: the replica never has more than its places, tenants take
turns, the lowest priority is answered 429 with Retry-After, and every request ends answered (200 or 429)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import uvicorn
from aiohttp import test_utils, web

from loom.devstack.servers import free_port
from loom.workloads.activator.proxy import Upstream
from loom.workloads.picker.app import build_app
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.decide import Decider
from loom.workloads.picker.gate import FlowGate, gate_for
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod


class HeldReplica:
    """Answers a request only once `go` lets one through; records the tenants in the order it served them."""

    def __init__(self) -> None:
        self.go = asyncio.Semaphore(0)
        self.active = 0
        self.most_active = 0
        self.served: list[str] = []
        self.server: test_utils.TestServer | None = None

    async def completion(self, request: web.Request) -> web.Response:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await self.go.acquire()
        finally:
            self.active -= 1
        self.served.append(request.headers.get("x-tenant", "?"))
        return web.json_response({"ok": True})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.completion)
        self.server = test_utils.TestServer(app, host="127.0.0.1", port=free_port())
        await self.server.start_server()
        return f"127.0.0.1:{self.server.port}"


@contextlib.asynccontextmanager
async def picker(flow: dict[str, object]) -> AsyncIterator[tuple[str, HeldReplica, FlowGate, PickerState]]:
    replica = HeldReplica()
    endpoint = await replica.start()
    port = free_port()
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"},
                                          "port": port, "admin_port": free_port(), "retry_after_seconds": 7,
                                          "flow_control": flow})
    state = PickerState(config, PickerMetrics("ml/chat"))
    gate = gate_for(config, state)
    assert gate is not None
    state.set_replicas({endpoint: Pod("r0", "stable")})
    app = build_app(config, state, Upstream(), decider=Decider(state, wait_s=0.2, gate=gate))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", replica, gate, state
    finally:
        for _ in range(100):  # whatever the test left held goes, so the servers can stop
            replica.go.release()
        server.should_exit = True
        await task
        assert replica.server is not None
        await replica.server.close()


async def until(condition: object, what: str) -> None:
    for _ in range(500):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def ask(client: httpx.AsyncClient, url: str, tenant: str, priority: int | None = None) -> asyncio.Task[httpx.Response]:
    headers = {"x-tenant": tenant, **({"x-loom-priority": str(priority)} if priority is not None else {})}
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    return asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=body, headers=headers))


async def test_places_turns_shedding_and_every_request_answered() -> None:
    flow = {"maxInflightPerReplica": 2, "maxQueued": 3, "tenantHeader": "x-tenant", "defaultPriority": 0}
    async with picker(flow) as (url, replica, gate, state), httpx.AsyncClient(timeout=30) as client:
        first = [ask(client, url, "flood") for _ in range(2)]
        await until(lambda: replica.active == 2, "two requests in flight")
        flood = [ask(client, url, "flood") for _ in range(3)]
        await until(lambda: len(gate.queue) == 3, "three flood requests waiting")
        quiet = ask(client, url, "quiet")
        # The queue was full: the flood's newest is shed to make room for the quiet tenant's request.
        shed = await asyncio.wait_for(asyncio.shield(flood[-1]), 10)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "7"
        assert shed.json()["code"] == "picker_shed"
        batch = ask(client, url, "quiet", priority=-1)  # lower than everything waiting: shed at once
        low = await asyncio.wait_for(batch, 10)
        assert low.status_code == 429
        for _ in range(5):
            replica.go.release()
        answers = await asyncio.gather(*first, *flood[:-1], quiet)
        assert [a.status_code for a in answers] == [200] * 5
        # In flight never beyond the places; after the first two, the quiet tenant's turn came before the flood's
        # second waiting request.
        assert replica.most_active == 2
        assert replica.served[2:] == ["flood", "quiet", "flood"]
        assert gate.queue.inflight == 0 and len(gate.queue) == 0
        gate.queue.check()
        registry = state.metrics.registry
        assert registry.get_sample_value("loom_picker_flow_requests_total", {
            "service": "ml/chat", "tenant": "flood", "priority": "0", "outcome": "shed"}) == 1
        assert registry.get_sample_value("loom_picker_outcomes_total", {
            "service": "ml/chat", "outcome": "shed"}) == 2
