"""The picker's HTTP side with disaggregation, on 127.0.0.1: a real uvicorn serving it, real aiohttp replicas
behind it answering like vllm fronts. Each generation request is first sent to a prefill replica of the decode
replica's kv-version as a one-token request without stream, then to the decode replica as it came; the client's
Authorization reaches both; a failing or missing prefill replica leaves the decode replica to answer alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import uvicorn
from aiohttp import test_utils, web

from loom.devstack.servers import free_port
from loom.workloads.activator.proxy import Upstream
from loom.workloads.picker.app import build_app
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod


class Replica:
    """A stand-in for one vllm front: records each body and the Authorization it saw; `status`: what it answers."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name = name
        self.status = status
        self.bodies: list[dict[str, object]] = []
        self.auth: list[str | None] = []
        self.server: test_utils.TestServer | None = None

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        if self.status != 200:
            return web.json_response({"error": {"message": "engine dead"}}, status=self.status)
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(f"data: {self.name}-{i}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({"replica": self.name})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_get("/v1/models", lambda r: web.json_response({"replica": self.name}))
        self.server = test_utils.TestServer(app, host="127.0.0.1", port=free_port())
        await self.server.start_server()
        return f"127.0.0.1:{self.server.port}"


class Running:
    def __init__(self, url: str, state: PickerState, replicas: dict[str, Replica]) -> None:
        self.url, self.state, self.replicas = url, state, replicas

    def by_name(self, name: str) -> Replica:
        return next(r for r in self.replicas.values() if r.name == name)

    def paths(self, path: str, reason: str) -> float:
        value = self.state.metrics.registry.get_sample_value(
            "loom_picker_disaggregation_total", {"service": "ml/chat", "path": path, "reason": reason})
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def picker(replicas: list[tuple[Replica, str, str]], extra: dict[str, str] | None = None,
                 policy: str = "prefix-cache") -> AsyncIterator[Running]:
    """`replicas`: (replica, role, kv-version); `extra`: endpoint -> role:version of replicas that are not up."""
    pods: dict[str, Pod] = {}
    started: dict[str, Replica] = {}
    for replica, role, version in replicas:
        endpoint = await replica.start()
        started[endpoint] = replica
        pods[endpoint] = Pod(replica.name, "stable", role, version)
    for endpoint, spec in (extra or {}).items():
        role, _, version = spec.partition(":")
        pods[endpoint] = Pod(endpoint, "stable", role, version)
    port = free_port()
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"},
                                          "port": port, "policy": policy,
                                          "disaggregation": {"prefillTimeoutSeconds": 5}})
    state = PickerState(config, PickerMetrics("ml/chat"), draw=lambda: 0.5)
    state.set_replicas(pods)
    server = uvicorn.Server(uvicorn.Config(build_app(config, state, Upstream(), no_replica_wait_s=0.2),
                                           host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{port}", state, started)
    finally:
        server.should_exit = True
        await task
        for replica in started.values():
            assert replica.server is not None
            await replica.server.close()


CHAT = {"model": "m", "max_tokens": 32, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "a long question " * 100}]}
AUTH = {"authorization": "Bearer k1"}


async def test_a_chat_request_is_prefilled_then_decoded_with_the_clients_key_on_both() -> None:
    prefill, decode = Replica("prefill"), Replica("decode")
    async with picker([(prefill, "prefill", "v1"), (decode, "decode", "v1")]) as p, httpx.AsyncClient() as client:
        answer = await client.post(f"{p.url}/v1/chat/completions", json=CHAT, headers=AUTH)
        assert answer.status_code == 200
        assert answer.text.startswith("data: decode-0")  # the decode replica's stream, relayed
        assert prefill.bodies == [{**{k: v for k, v in CHAT.items() if k != "stream_options"},
                                   "max_tokens": 1, "stream": False, "n": 1}]
        assert decode.bodies == [CHAT]  # the client's request as it came
        assert prefill.auth == decode.auth == ["Bearer k1"]
        assert p.paths("prefill+decode", "prefilled") == 1
        assert p.state.inflight == {}


async def test_requests_that_are_no_generation_go_to_a_decode_replica_alone() -> None:
    prefill, decode = Replica("prefill"), Replica("decode")
    async with picker([(prefill, "prefill", "v1"), (decode, "decode", "v1")]) as p, httpx.AsyncClient() as client:
        for _ in range(3):
            answer = await client.get(f"{p.url}/v1/models", headers=AUTH)
            assert answer.json() == {"replica": "decode"}
        assert prefill.bodies == [] and p.paths("prefill+decode", "prefilled") == 0


async def test_a_failing_prefill_replica_leaves_the_decode_replica_to_answer() -> None:
    prefill, decode = Replica("prefill", status=500), Replica("decode")
    async with picker([(prefill, "prefill", "v1"), (decode, "decode", "v1")]) as p, httpx.AsyncClient() as client:
        body = {"model": "m", "prompt": "complete this " * 50, "max_tokens": 8}
        answer = await client.post(f"{p.url}/v1/completions", json=body, headers=AUTH)
        assert answer.status_code == 200 and answer.json() == {"replica": "decode"}
        assert len(prefill.bodies) == 1 and decode.bodies == [body]
        assert p.paths("decode-only", "prefill_failed") == 1 and p.paths("prefill+decode", "prefilled") == 0
        assert p.state.inflight == {}


async def test_an_unreachable_prefill_replica_is_forgotten_and_the_decode_answers() -> None:
    decode = Replica("decode")
    gone = f"127.0.0.1:{free_port()}"  # listed, nothing listening: a prefill pod going away
    async with picker([(decode, "decode", "v1")], extra={gone: "prefill:v1"}) as p, httpx.AsyncClient() as client:
        answer = await client.post(f"{p.url}/v1/chat/completions", json={**CHAT, "stream": False}, headers=AUTH)
        assert answer.status_code == 200 and answer.json() == {"replica": "decode"}
        assert p.paths("decode-only", "prefill_failed") == 1
        assert gone not in p.state.pods  # nothing more for it until the pod watch lists it again


async def test_during_a_rollout_each_decode_gets_its_own_versions_prefill() -> None:
    old_prefill, old_decode = Replica("old-prefill"), Replica("old-decode")
    new_prefill, new_decode = Replica("new-prefill"), Replica("new-decode")
    live = [(old_prefill, "prefill", "v1"), (old_decode, "decode", "v1"),
            (new_prefill, "prefill", "v2"), (new_decode, "decode", "v2")]
    async with picker(live, policy="round-robin") as p, httpx.AsyncClient() as client:
        for i in range(12):
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"question {i} " * 80}]}
            answer = await client.post(f"{p.url}/v1/chat/completions", json=body, headers=AUTH)
            assert answer.status_code == 200
        for prefill, decode in ((old_prefill, old_decode), (new_prefill, new_decode)):
            # Every prompt a version's decode replica served was prefilled on that version's prefill replica.
            assert decode.bodies, "both versions served some"
            prompts = [json.dumps(b["messages"]) for b in decode.bodies]
            assert prompts == [json.dumps(b["messages"]) for b in prefill.bodies]
        assert p.paths("prefill+decode", "prefilled") == 12


async def test_no_prefill_replica_of_the_decodes_version_is_decode_only() -> None:
    old_prefill, new_decode = Replica("old-prefill"), Replica("new-decode")
    async with picker([(old_prefill, "prefill", "v1"), (new_decode, "decode", "v2")]) as p, \
            httpx.AsyncClient() as client:
        answer = await client.post(f"{p.url}/v1/chat/completions", json={**CHAT, "stream": False}, headers=AUTH)
        assert answer.json() == {"replica": "new-decode"}
        assert old_prefill.bodies == []  # never a v1 prefill for a v2 decode
        assert p.paths("decode-only", "no_prefill_replica") == 1
