"""The endpoint picker's HTTP side on 127.0.0.1: a real uvicorn serving it, real aiohttp replicas behind it that
answer like the vllm front (their name, the key they saw, a stream) and serve vllm:* series on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
import uvicorn
from aiohttp import test_utils, web

from loom.devstack.servers import free_port
from loom.workloads.activator.proxy import Upstream
from loom.workloads.picker.app import build_admin_app, build_app
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.poll import poll_once
from loom.workloads.picker.state import PickerState, Pod

SYSTEMS = [f"System prompt number {i}: answer as the {i}th expert would, briefly and precisely. " * 12
           for i in range(4)]


class Replica:
    """A stand-in for one vllm front: answers with its name and the Authorization it saw; 401 without a key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waiting = 0
        self.seen: list[str] = []
        self.server: test_utils.TestServer | None = None

    async def completion(self, request: web.Request) -> web.StreamResponse:
        if not request.headers.get("authorization"):
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        body = await request.json()
        self.seen.append(body["messages"][0]["content"])
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(f"data: {i}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({"replica": self.name, "auth": request.headers["authorization"]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = (f"vllm:num_requests_waiting{{engine=\"0\"}} {self.waiting}\n"
                "vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n"
                "vllm:prefix_cache_queries_total{engine=\"0\"} 100\n"
                "vllm:prefix_cache_hits_total{engine=\"0\"} 40\n"
                "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n")
        return web.Response(text=text, content_type="text/plain")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_get("/metrics", self.metrics)
        self.server = test_utils.TestServer(app, host="127.0.0.1", port=free_port())
        await self.server.start_server()
        return f"127.0.0.1:{self.server.port}"


class Running:
    def __init__(self, url: str, state: PickerState, replicas: dict[str, Replica], admin: str) -> None:
        self.url, self.state, self.replicas, self.admin = url, state, replicas, admin

    def sample(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, {"service": "ml/chat", **labels})
        return 0.0 if value is None else value

    async def poll(self) -> None:
        async with aiohttp.ClientSession() as session:
            await poll_once(self.state, session)


@contextlib.asynccontextmanager
async def picker(n: int = 3, **overrides: object) -> AsyncIterator[Running]:
    replicas = {}
    for i in range(n):
        replica = Replica(f"r{i}")
        replicas[await replica.start()] = replica
    port, admin_port = free_port(), free_port()
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"},
                                          "port": port, "admin_port": admin_port, **overrides})
    state = PickerState(config, PickerMetrics("ml/chat"), draw=lambda: 0.5)
    state.set_replicas({e: Pod(r.name, "stable") for e, r in replicas.items()})
    servers = [uvicorn.Server(uvicorn.Config(build_app(config, state, Upstream(), no_replica_wait_s=0.2),
                                             host="127.0.0.1", port=port, log_level="warning")),
               uvicorn.Server(uvicorn.Config(build_admin_app(state, lambda: True), host="127.0.0.1",
                                             port=admin_port, log_level="warning"))]
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        await asyncio.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{port}", state, replicas, f"http://127.0.0.1:{admin_port}")
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)
        for replica in replicas.values():
            assert replica.server is not None
            await replica.server.close()


def chat(system: str, user: str, **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            **extra}


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, object], key: str | None = "k1") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)


async def test_requests_sharing_a_prefix_land_on_one_replica_and_prefixes_spread() -> None:
    async with picker() as p, httpx.AsyncClient(timeout=10) as client:
        await p.poll()
        assert p.state.block_size == 16
        for round_ in range(3):
            for i, system in enumerate(SYSTEMS):
                answer = await ask(client, p.url, chat(system, f"question {round_}-{i}"))
                assert answer.status_code == 200 and answer.json()["auth"] == "Bearer k1"
        homes = {system: {r.name for r in p.replicas.values() if system in r.seen} for system in SYSTEMS}
        assert all(len(names) == 1 for names in homes.values()), homes
        assert len({next(iter(n)) for n in homes.values()}) == 3  # four prefixes over three replicas: all used
        assert p.sample("loom_picker_decisions_total", reason="prefix") == 8
        assert p.sample("loom_picker_decisions_total", reason="load") == 4
        assert p.sample("loom_picker_decision_seconds_count") == 12
        # The engines' own hit rate per replica (40 of 100 queried tokens here).
        assert p.sample("loom_picker_replica_prefix_cache_hit_ratio", replica="r0") == 0.4
        exposition = (await client.get(f"{p.admin}/metrics")).text
        assert 'loom_picker_decisions_total{reason="prefix",service="ml/chat"} 8.0' in exposition


async def test_keys_pass_through_and_the_replicas_answer_stands() -> None:
    async with picker(n=2) as p, httpx.AsyncClient(timeout=10) as client:
        refused = await ask(client, p.url, chat(SYSTEMS[0], "q"), key=None)
        assert refused.status_code == 401 and refused.json() == {"error": {"code": "invalid_api_key"}}
        streamed = await ask(client, p.url, chat(SYSTEMS[0], "q", stream=True))
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert streamed.text.count("data: ") == 4
        assert not p.state.inflight  # every answer read to its end: nothing counted in flight


async def test_an_overloaded_replica_gets_nothing_new() -> None:
    async with picker(n=2) as p, httpx.AsyncClient(timeout=10) as client:
        first = await ask(client, p.url, chat(SYSTEMS[0], "q"))
        home = first.json()["replica"]
        next(r for r in p.replicas.values() if r.name == home).waiting = 8  # its engine's queue is full
        await p.poll()
        answers = [(await ask(client, p.url, chat(SYSTEMS[0], f"q{i}"))).json()["replica"] for i in range(4)]
        assert home not in answers
        assert p.sample("loom_picker_decisions_total", reason="load_override") >= 1
        assert p.sample("loom_picker_replicas", state="overloaded") == 1


async def test_a_replica_going_away_costs_no_request() -> None:
    async with picker(n=2) as p, httpx.AsyncClient(timeout=10) as client:
        first = await ask(client, p.url, chat(SYSTEMS[1], "q"))
        home = first.json()["replica"]
        endpoint, replica = next((e, r) for e, r in p.replicas.items() if r.name == home)
        assert replica.server is not None
        await replica.server.close()  # refuses connections now; the pod watch has not seen it yet
        again = await ask(client, p.url, chat(SYSTEMS[1], "q2"))
        assert again.status_code == 200 and again.json()["replica"] != home
        assert endpoint not in p.state.pods
        assert p.sample("loom_picker_outcomes_total", outcome="retried") == 1


async def test_no_replica_is_a_503_with_retry_after() -> None:
    async with picker(n=1) as p, httpx.AsyncClient(timeout=10) as client:
        p.state.set_replicas({})
        answer = await ask(client, p.url, chat(SYSTEMS[0], "q"))
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["code"] == "picker_no_replica"


async def test_state_lost_falls_back_to_load_and_relearns() -> None:
    async with picker(n=2) as p, httpx.AsyncClient(timeout=10) as client:
        await ask(client, p.url, chat(SYSTEMS[2], "q"))
        fresh = PickerState(p.state.config, PickerMetrics("ml/chat"))  # a restarted picker
        fresh.set_replicas(p.state.pods)
        pick = fresh.pick("/v1/chat/completions", json.dumps(chat(SYSTEMS[2], "q")).encode(), {})
        assert pick is not None and pick.decision.reason == "load"
        fresh.sent(pick)
        again = fresh.pick("/v1/chat/completions", json.dumps(chat(SYSTEMS[2], "q3")).encode(), {})
        assert again is not None and (again.decision.reason, again.decision.endpoint) == (
            "prefix", pick.decision.endpoint)


async def test_session_affinity_by_header() -> None:
    async with picker(n=3, session_header="x-session-id") as p, httpx.AsyncClient(timeout=10) as client:
        names = set()
        for i, system in enumerate(SYSTEMS):
            answer = await client.post(f"{p.url}/v1/chat/completions", json=chat(system, f"q{i}"),
                                       headers={"authorization": "Bearer k", "x-session-id": "s-1"})
            names.add(answer.json()["replica"])
        assert len(names) == 1  # different prompts, one session: one replica
        assert p.sample("loom_picker_decisions_total", reason="session") == 3


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
async def test_other_policies_spread_one_prefix(policy: str) -> None:
    async with picker(n=2, policy=policy) as p, httpx.AsyncClient(timeout=10) as client:
        names = [(await ask(client, p.url, chat(SYSTEMS[0], f"q{i}"))).json()["replica"] for i in range(4)]
        assert set(names) == {"r0", "r1"}
