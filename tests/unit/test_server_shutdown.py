"""SIGTERM on the model server (lifecycle.py), with a real uvicorn server in process: it turns unready at
once, keeps answering during its drain window with `Connection: close`, then refuses new connections while
the stream in flight runs to its last token, and ends without re-raising the signal (exit code 0)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from loom.workloads.server.app import build_app
from loom.workloads.server.config import ServerConfig
from loom.workloads.server.handlers import NoopModel
from loom.workloads.server.lifecycle import Drain, GracefulServer
from loom.workloads.server.testing import child_env, until_refused

pytestmark = pytest.mark.timeout(60)

TOKENS = 6


class GatedStream(NoopModel):
    """Echoes infer; generate yields one token, then the rest once `go` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        yield "t0"
        self.go.wait(timeout=30)
        for i in range(1, TOKENS):
            yield f"t{i}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_drain_needs_a_non_negative_window() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Drain(-1)


async def test_sigterm_drains_then_finishes_the_stream_in_flight(tmp_path: Path) -> None:
    port = _free_port()
    config = ServerConfig(model_name="slow", host="127.0.0.1", port=port)
    model = GatedStream("slow")
    drain = Drain(3600)  # ended by the second SIGTERM below, never by the clock
    app = build_app(config, model, tmp_path, drain)
    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), drain)
    serving = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    infer = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client:
        for _ in range(300):
            try:
                if (await client.get("/v2/health/ready")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
        assert (await client.post("/v2/models/slow/infer", json=infer)).headers.get("connection") != "close"

        async with (
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as streamer,
            streamer.stream("POST", "/v2/models/slow/generate_stream", json={"text_input": "x"}) as stream,
        ):
            lines = stream.aiter_lines()
            assert await anext(lines) == 'data: {"model_name": "slow", "model_version": null, "text_output": "t0"}'

            server.handle_exit(signal.SIGTERM, None)
            ready = await client.get("/v2/health/ready")
            assert (ready.status_code, ready.json()) == (503, {"ready": False})
            assert (await client.get("/v2/models/slow/ready")).status_code == 503
            answer = await client.post("/v2/models/slow/infer", json=infer)  # still served while draining
            assert answer.status_code == 200 and answer.headers["connection"] == "close"
            assert answer.json()["outputs"][0]["data"] == [1.0]
            assert not server.should_exit

            server.handle_exit(signal.SIGTERM, None)  # again: the drain window ends now
            await until_refused(client, "/v2/health/live", "server")
            assert not serving.done()  # the stream in flight holds the shutdown

            model.go.set()
            rest = [json.loads(line.removeprefix("data: "))["text_output"] async for line in lines if line]
            assert rest == [f"t{i}" for i in range(1, TOKENS)]
    await asyncio.wait_for(serving, 30)


def test_the_server_process_exits_0_after_a_drained_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    config = tmp_path / "server.json"
    doc = {"modelName": "echo", "handler": "noop", "storageUri": str(tmp_path), "host": "127.0.0.1", "port": port}
    config.write_text(json.dumps(doc))
    argv = [sys.executable, "-m", "loom.workloads.server", "--config", str(config), "--drain-seconds", "0.2"]
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    try:
        for _ in range(600):
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait()
    assert "SIGTERM: draining" in (tmp_path / "server.log").read_text()
