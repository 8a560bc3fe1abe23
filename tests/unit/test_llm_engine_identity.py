"""The front talks only to the engine it started.

Another process answering on the engine's port (an engine of another front that won the port, the local stack
before pods had private loopbacks) passes /health; it must not pass for this front's engine. The front's own
engine here is a stand-in program that never listens and exits with code 3, as a vLLM that lost the port race
does (EADDRINUSE): the front reports that exit instead of adopting the stranger.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from loom.devstack.servers import free_port
from loom.workloads.llm.config import LlmServerConfig
from loom.workloads.llm.engine import EngineUnavailable, VllmEngine, engine_environment


def stranger_app(seen: list[str], guarded: bool) -> Starlette:
    """What another vLLM engine with its own key looks like (guarded: /health open, /v1 refused), or a server that
    ignores the key and answers every GET with 200 (unguarded: an operator's metrics server, prometheus_client's,
    on 127.0.0.1:8081, which CI once found on the engine's port)."""

    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def models(request: Request) -> PlainTextResponse | JSONResponse:
        seen.append(request.headers.get("authorization", ""))
        if not guarded:
            return PlainTextResponse("# HELP python_info Python platform information\n")
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models)])


@pytest.fixture(params=[True, False], ids=["guarded", "ignores-the-key"])
def stranger(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[str]]]:
    port, seen = free_port(), []
    app = stranger_app(seen, guarded=request.param)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    yield port, seen
    server.should_exit = True
    thread.join(timeout=10)


def test_a_stranger_on_the_engine_port_is_not_taken_for_the_front_engine(
    stranger: tuple[int, list[str]], tmp_path: Path
) -> None:
    port, seen = stranger
    program = tmp_path / "engine-that-lost-the-port"
    program.write_text("#!/bin/sh\nsleep 2\nexit 3\n")
    program.chmod(0o755)
    config = LlmServerConfig(model_name="m", model_dir=str(tmp_path), engine_port=port, engine_python=str(program),
                             engine_start_timeout_s=60)

    async def start() -> None:
        engine = VllmEngine(config)
        await engine.start()
        try:
            await engine.wait_ready()
        finally:
            await engine.stop()

    with pytest.raises(EngineUnavailable, match="exited with code 3"):
        asyncio.run(start())
    assert seen and all(header.startswith("Bearer ") and len(header) > 20 for header in seen)


def test_the_engine_key_replaces_any_inherited_one_and_is_not_on_the_command_line() -> None:
    config = LlmServerConfig(model_name="m", model_dir="/models/m")
    env = engine_environment(config, {"VLLM_API_KEY": "inherited", "PATH": "/bin"}, engine_key="drawn")
    assert env["VLLM_API_KEY"] == "drawn" and env["PATH"] == "/bin"
    assert "VLLM_API_KEY" not in engine_environment(config, {"VLLM_API_KEY": "inherited"})
