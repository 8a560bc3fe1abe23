"""Run a real model-server process (uvicorn, the pod's own command) for tests and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # PYTHONSAFEPATH: the repository's `operator` folder must never shadow the stdlib module.
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


@contextlib.contextmanager
def running(
    argv: list[str],
    url: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 180.0,
    ready_url: str | None = None,
) -> Iterator[str]:
    """Start ``argv``, yield ``url`` once ``ready_url`` (default: its /v2/health/ready) answers 200, stop it
    afterwards."""
    ready_url = ready_url or f"{url}/v2/health/ready"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env(env), cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout_s:.0f}s:\n{log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def model_server(config: Path, log: Path, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``python -m loom.workloads.server --config config``; the URL comes from the config's host/port."""
    doc = json.loads(config.read_text())
    url = f"http://{doc.get('host', '127.0.0.1')}:{doc['port']}"
    argv = [sys.executable, "-m", "loom.workloads.server", "--config", str(config)]
    with running(argv, url, log, env) as ready:
        yield ready


async def until_refused(client: httpx.AsyncClient, path: str, what: str, attempts: int = 300) -> None:
    """Ask `path` until the server refuses new connections (its drain window over); AssertionError if it never does.
    A connection accepted just before the listener closed and then closed unanswered (RemoteProtocolError) is not
    yet a refusal: the next attempt opens a new one."""
    for _ in range(attempts):
        try:
            await client.get(path)
        except httpx.ConnectError:
            return
        except httpx.RemoteProtocolError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"the {what} still accepts connections after its drain window")
