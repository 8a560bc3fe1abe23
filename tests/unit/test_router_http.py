"""The router over real HTTP: uvicorn on 127.0.0.1 for the router and for its upstreams (tiny Starlette
models, and the real model server), httpx and tritonclient as the clients."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tritonclient.http import InferenceServerClient, InferInput
from tritonclient.utils import InferenceServerException

from loom.workloads.router.app import build_app
from loom.workloads.router.config import RouterConfig
from loom.workloads.router.testing import serving
from loom.workloads.server.app import build_app as build_server_app
from loom.workloads.server.config import ServerConfig
from loom.workloads.server.handlers import NoopModel

pytestmark = pytest.mark.timeout(120)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Upstream:
    """A tiny OIP model: y = factor * x; x == 13 answers 500, x == 7 answers 200 with an error body.
    generate upper-cases and appends a suffix; generate_stream sends one event per character and holds
    after the first until ``gate`` is set."""

    def __init__(self, name: str, factor: float = 1.0, suffix: str = ""):
        self.name = name
        self.seen: list[tuple[dict[str, str], bytes]] = []
        self.gate = threading.Event()
        self.gate.set()

        async def infer(request: Request) -> Response:
            body = await request.body()
            self.seen.append((dict(request.headers), body))
            doc = json.loads(body)
            data = doc["inputs"][0]["data"]
            if 13 in data:
                return JSONResponse({"error": "thirteen"}, status_code=500)
            if 7 in data:
                return JSONResponse({"error": "seven is an error, said with a 200"})
            out = {"name": "y", "datatype": "FP64", "shape": [len(data)], "data": [v * factor for v in data]}
            return JSONResponse({"model_name": name, "id": doc.get("id"), "outputs": [out]})

        async def generate(request: Request) -> Response:
            body = await request.body()
            self.seen.append((dict(request.headers), body))
            return JSONResponse({"model_name": name, "text_output": json.loads(body)["text_input"].upper() + suffix})

        async def generate_stream(request: Request) -> Response:
            body = await request.body()
            self.seen.append((dict(request.headers), body))
            text = json.loads(body)["text_input"] + suffix

            async def events() -> Any:
                for index, char in enumerate(text):
                    if index == 1:
                        await asyncio.to_thread(self.gate.wait, 30)
                    yield f"data: {json.dumps({'model_name': name, 'text_output': char})}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        self.app = Starlette(routes=[
            Route(f"/v2/models/{name}/infer", infer, methods=["POST"]),
            Route(f"/v2/models/{name}/generate", generate, methods=["POST"]),
            Route(f"/v2/models/{name}/generate_stream", generate_stream, methods=["POST"]),
        ])


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, tuple[Upstream, str]]]:
    models = {"double": Upstream("double", 2), "triple": Upstream("triple", 3), "tail": Upstream("tail", 1, "!")}
    with serving(models["double"].app) as a, serving(models["triple"].app) as b, serving(models["tail"].app) as c:
        yield {"double": (models["double"], a), "triple": (models["triple"], b), "tail": (models["tail"], c)}


def router_config(nodes: dict[str, Any], upstreams: dict[str, tuple[Upstream, str]], **extra: Any) -> RouterConfig:
    return RouterConfig.model_validate({
        "graphName": "pipeline",
        "nodes": nodes,
        "services": {name: {"url": url, "modelName": model.name} for name, (model, url) in upstreams.items()},
        **extra,
    })


SEQUENCE = {"root": {"routerType": "Sequence", "steps": [
    {"serviceName": "double", "dependency": "Hard"},
    {"serviceName": "triple", "data": "$response", "dependency": "Hard"},
]}}


@pytest.fixture(scope="module")
def router(upstreams: dict[str, tuple[Upstream, str]]) -> Iterator[str]:
    with serving(build_app(router_config(SEQUENCE, upstreams))) as url:
        yield url


def infer_body(*values: float, **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP64", "shape": [len(values)], "data": list(values)}], **extra}


def test_health_metadata_and_unknown_model(router: str) -> None:
    assert httpx.get(f"{router}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{router}/v2/health/ready").status_code == 200
    assert httpx.get(f"{router}/v2/models/pipeline").json()["name"] == "pipeline"
    assert httpx.get(f"{router}/v2/models/pipeline/ready").json() == {"name": "pipeline", "ready": True}
    missing = httpx.post(f"{router}/v2/models/other/infer", json=infer_body(1))
    assert (missing.status_code, missing.json()["code"]) == (404, "not_found")


def test_sequence_over_http_chains_and_forwards_key_and_trace(
    router: str, upstreams: dict[str, tuple[Upstream, str]]
) -> None:
    double, triple = upstreams["double"][0], upstreams["triple"][0]
    double.seen.clear()
    triple.seen.clear()
    body = json.dumps(infer_body(1, 2, id="r-1")).encode()
    response = httpx.post(
        f"{router}/v2/models/pipeline/infer", content=body,
        headers={"content-type": "application/json", "authorization": "Bearer k-1", "traceparent": TRACEPARENT},
    )
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [6.0, 12.0]
    assert response.headers["loom-graph-steps"] == "root.double=ok,root.triple=ok"
    headers, sent = double.seen[-1]
    assert sent == body  # the caller's bytes, not re-encoded
    for headers, _ in (double.seen[-1], triple.seen[-1]):
        assert headers["authorization"] == "Bearer k-1"
        version, trace_id, span_id, flags = headers["traceparent"].split("-")
        assert (version, trace_id, flags) == ("00", "4bf92f3577b34da6a3ce929d0e0e4736", "01")
        assert span_id != "00f067aa0ba902b7"  # each step is a child span of the caller's


def test_without_a_caller_trace_the_steps_share_a_new_one(
    router: str, upstreams: dict[str, tuple[Upstream, str]]
) -> None:
    httpx.post(f"{router}/v2/models/pipeline/infer", json=infer_body(1)).raise_for_status()
    first = upstreams["double"][0].seen[-1][0]["traceparent"].split("-")
    second = upstreams["triple"][0].seen[-1][0]["traceparent"].split("-")
    assert first[1] == second[1] and first[2] != second[2]


@pytest.mark.parametrize(
    ("value", "status", "code", "upstream_status"),
    [(13, 502, "upstream_error", 500), (7, 502, "upstream_error_body", 200)],
)
def test_a_failing_hard_step_answers_a_structured_error(
    router: str, value: int, status: int, code: str, upstream_status: int
) -> None:
    # double passes 7 on as 14 and 13 as 26: send the value that fails at the first step.
    response = httpx.post(f"{router}/v2/models/pipeline/infer", json=infer_body(value))
    assert response.status_code == status
    doc = response.json()
    assert (doc["code"], doc["graph"], doc["node"], doc["step"], doc["service"]) == (
        code, "pipeline", "root", "double", "double")
    assert doc["upstream_status"] == upstream_status
    assert [(s["step"], s["outcome"]) for s in doc["steps"]] == [("double", "failed")]
    assert response.headers["loom-graph-steps"] == "root.double=failed"


def test_metrics_use_the_server_names_and_count_steps(router: str) -> None:
    httpx.post(f"{router}/v2/models/pipeline/infer", json=infer_body(2)).raise_for_status()
    text = httpx.get(f"{router}/metrics").text
    assert 'loom_server_requests_total{code="200",endpoint="infer",model="pipeline"}' in text
    assert 'loom_router_step_duration_seconds_count{graph="pipeline",node="root",step="triple",target="triple"}' in text
    assert 'loom_router_step_errors_total{code="upstream_error",dependency="Hard",graph="pipeline"' in text


def test_unreachable_upstream_is_a_502_naming_the_service(upstreams: dict[str, tuple[Upstream, str]]) -> None:
    config = RouterConfig.model_validate({
        "graphName": "g", "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "gone"}]}},
        "services": {"gone": {"url": "http://127.0.0.1:9", "modelName": "gone"}},
    })
    with serving(build_app(config)) as url:
        response = httpx.post(f"{url}/v2/models/g/infer", json=infer_body(1))
    doc = response.json()
    assert (response.status_code, doc["code"], doc["service"]) == (502, "upstream_unreachable", "gone")


def test_streaming_passes_events_on_as_they_arrive(upstreams: dict[str, tuple[Upstream, str]]) -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "double"}, {"serviceName": "tail", "data": "$response"}]}}
    tail = upstreams["tail"][0]
    with serving(build_app(router_config(nodes, upstreams))) as url:
        tail.gate.clear()
        try:
            with httpx.stream("POST", f"{url}/v2/models/pipeline/generate_stream",
                              json={"text_input": "ab", "parameters": {"max_tokens": 4}}) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                chunks = response.iter_raw()
                first = next(chunks)
                # The upstream holds its second event until the gate opens: the router sent the first
                # one on without waiting for the rest.
                assert first == b'data: {"model_name": "tail", "text_output": "A"}\n\n'
                tail.gate.set()
                rest = b"".join(chunks)
        finally:
            tail.gate.set()
    events = [json.loads(line[len("data: "):]) for line in (first + rest).decode().split("\n\n") if line]
    # double's generate (non-streaming) upper-cased the prompt; tail streamed it back with "!" appended.
    assert "".join(e["text_output"] for e in events) == "AB!"
    assert json.loads(tail.seen[-1][1]) == {"text_input": "AB", "parameters": {"max_tokens": 4}}


def test_stream_whose_last_position_is_an_ensemble_is_one_event(upstreams: dict[str, tuple[Upstream, str]]) -> None:
    nodes = {"root": {"routerType": "Ensemble", "steps": [{"serviceName": "double"}, {"serviceName": "tail"}]}}
    with serving(build_app(router_config(nodes, upstreams))) as url:
        response = httpx.post(f"{url}/v2/models/pipeline/generate_stream", json={"text_input": "hi"})
    assert response.status_code == 200
    assert response.text == 'data: {"model_name":"pipeline","text_outputs":{"double":"HI","tail":"HI!"}}\n\n'


@pytest.fixture(scope="module")
def real_server(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch_module.setenv("ROUTER_TEST_KEYS", "graph-key")
    config = ServerConfig.model_validate(
        {"modelName": "echo", "handler": "noop", "auth": {"apiKeysEnv": "ROUTER_TEST_KEYS"}}
    )
    with serving(build_server_app(config, NoopModel("echo", "1", {}))) as url:
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "model server never became ready"
            time.sleep(0.05)
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_an_unmodified_oip_client_calls_a_graph_of_real_model_servers(real_server: str) -> None:
    config = RouterConfig.model_validate({
        "graphName": "echo-twice",
        "nodes": {"root": {"routerType": "Sequence", "steps": [
            {"serviceName": "first", "dependency": "Hard"},
            {"serviceName": "second", "data": "$response", "dependency": "Hard"}]}},
        "services": {"first": {"url": real_server, "modelName": "echo"},
                     "second": {"url": real_server, "modelName": "echo"}},
    })
    floats = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    with serving(build_app(config)) as url:
        client = InferenceServerClient(url=url.removeprefix("http://"))
        try:
            assert client.is_server_ready()
            assert client.get_model_metadata("echo-twice")["name"] == "echo-twice"
            for binary in (True, False):
                tensor = InferInput("f", [2, 3], "FP32")
                tensor.set_data_from_numpy(floats, binary_data=binary)
                result = client.infer("echo-twice", [tensor], request_id="q-1",
                                      headers={"Authorization": "Bearer graph-key"})
                np.testing.assert_array_equal(result.as_numpy("f"), floats)
                assert result.get_response()["id"] == "q-1"
            # The API key reaches the model servers: without it the first step answers 401, passed on.
            with pytest.raises(InferenceServerException, match="a valid API key is required"):
                client.infer("echo-twice", [tensor])
        finally:
            client.close()
