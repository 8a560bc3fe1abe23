"""SIGTERM on the InferenceGraph router (the shared loom.workloads.common.lifecycle, as the model server): with a
real router and a real upstream in process, it turns unready at once, keeps answering during its drain window with
`Connection: close`, then refuses new connections while a request in flight through the graph finishes; and the
router process exits 0 after a drained SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loom.workloads.common.lifecycle import Drain, GracefulServer
from loom.workloads.router.app import build_app
from loom.workloads.router.config import RouterConfig
from loom.workloads.server.testing import child_env, until_refused

pytestmark = pytest.mark.timeout(60)

INFER = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _upstream(arrived: asyncio.Event, gate: asyncio.Event) -> Starlette:
    """A model that sets `arrived` when an infer reaches it and answers once `gate` is set."""

    async def infer(request: Request) -> Response:
        arrived.set()
        await gate.wait()
        return JSONResponse({"model_name": "m", "outputs": [{"name": "y", "shape": [1], "datatype": "FP32",
                                                             "data": [2.0]}]})  # fmt: skip

    return Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"])])


async def _until_ready(client: httpx.AsyncClient, path: str) -> None:
    for _ in range(300):
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(path)).status_code in (200, 404, 405):
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never answered")


async def test_sigterm_drains_then_finishes_the_request_in_flight() -> None:
    arrived, gate = asyncio.Event(), asyncio.Event()
    up_port, port = _free_port(), _free_port()
    upstream = uvicorn.Server(
        uvicorn.Config(_upstream(arrived, gate), host="127.0.0.1", port=up_port, log_level="warning")
    )
    upstream_task = asyncio.create_task(upstream.serve())
    config = RouterConfig.model_validate({
        "graphName": "g", "host": "127.0.0.1", "port": port,
        "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "m"}]}},
        "services": {"m": {"url": f"http://127.0.0.1:{up_port}", "modelName": "m"}},
    })  # fmt: skip
    drain = Drain(3600)  # ended by the second SIGTERM below, never by the clock
    server = GracefulServer(
        uvicorn.Config(build_app(config, drain=drain), host="127.0.0.1", port=port, log_level="warning"), drain
    )
    serving = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        async with (
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client,
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as other,
        ):
            await _until_ready(client, "/v2/health/ready")
            await _until_ready(client, f"http://127.0.0.1:{up_port}/v2/models/m/infer")
            assert (await client.get("/v2/health/ready")).status_code == 200
            in_flight = asyncio.create_task(other.post("/v2/models/g/infer", json=INFER))
            # Wait until the request is really in flight (through the router, at the upstream): a fixed sleep lost
            # the race under load, and the request then met the closing listener (httpx.ReadError).
            await asyncio.wait_for(arrived.wait(), 30)

            server.handle_exit(signal.SIGTERM, None)
            ready = await client.get("/v2/health/ready")
            assert (ready.status_code, ready.json()) == (503, {"ready": False})
            assert ready.headers["connection"] == "close"
            assert (await client.get("/v2/models/g/ready")).status_code == 503
            meta = await client.get("/v2/models/g")  # still served while draining, keep-alive off
            assert meta.status_code == 200 and meta.headers["connection"] == "close"
            assert not server.should_exit

            server.handle_exit(signal.SIGTERM, None)  # again: the drain window ends now
            await until_refused(client, "/v2/health/live", "router")
            assert not serving.done() and not in_flight.done()  # the request in flight holds the shutdown

            gate.set()
            answer = await in_flight
            assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [2.0]
        await asyncio.wait_for(serving, 30)
    finally:
        gate.set()
        upstream.should_exit = True
        await asyncio.wait_for(upstream_task, 30)


def test_the_router_process_exits_0_after_a_drained_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    config = tmp_path / "router.json"
    config.write_text(json.dumps({
        "graphName": "g", "host": "127.0.0.1", "port": port,
        "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}},
        "services": {"a": {"url": "http://127.0.0.1:9", "modelName": "a"}},
    }))  # fmt: skip
    argv = [sys.executable, "-m", "loom.workloads.router", "--config", str(config), "--drain-seconds", "0.2"]
    with open(tmp_path / "router.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    try:
        for _ in range(600):
            assert process.poll() is None, (tmp_path / "router.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait()
    assert "SIGTERM: draining" in (tmp_path / "router.log").read_text()
