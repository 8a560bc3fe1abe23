"""The servers' connection lifetimes: idle kept-alive connections outlive every client pool Loom meets (the client,
never the server, closes an idle connection: no request is sent on a connection being closed), and the router
drains as long as the model server (the same kept-alive clients)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn

from loom.operator.kinds.inferencegraph.render import ROUTER_DRAIN_SECONDS
from loom.operator.kinds.inferenceservice.render import SERVER_DRAIN_SECONDS
from loom.workloads.common import lifecycle
from loom.workloads.common.lifecycle import DRAIN_SECONDS, KEEP_ALIVE_SECONDS, GracefulServer
from loom.workloads.router.__main__ import main as router_main
from loom.workloads.router.upstream import Upstreams
from loom.workloads.server.__main__ import main as server_main


def _configs_the_servers_run_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[uvicorn.Config]:
    seen: list[uvicorn.Config] = []
    monkeypatch.setattr(GracefulServer, "run", lambda self, sockets=None: seen.append(self.config))
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)  # the server's tuning, not this process's
    server = tmp_path / "server.json"
    server.write_text(json.dumps({"modelName": "echo", "handler": "noop", "storageUri": str(tmp_path)}))
    router = tmp_path / "router.json"
    router.write_text(json.dumps({
        "graphName": "g", "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}},
        "services": {"a": {"url": "http://127.0.0.1:9", "modelName": "a"}},
    }))  # fmt: skip
    assert server_main(["--config", str(server)]) == 0
    assert router_main(["--config", str(router)]) == 0
    return seen


def test_both_servers_keep_idle_connections_longer_than_their_clients_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    configs = _configs_the_servers_run_with(monkeypatch, tmp_path)
    assert [c.timeout_keep_alive for c in configs] == [KEEP_ALIVE_SECONDS, KEEP_ALIVE_SECONDS]
    # httpx's default idle expiry (uvicorn's default keep-alive equals it: the race), aiohttp's documented default
    # keepalive_timeout, and the router's own pool toward the model servers.
    for idle in (httpx.Limits().keepalive_expiry, 15.0, Upstreams.KEEPALIVE_S):
        assert idle is not None and idle < KEEP_ALIVE_SECONDS


def test_the_router_drains_as_long_as_the_model_server() -> None:
    assert ROUTER_DRAIN_SECONDS == SERVER_DRAIN_SECONDS == DRAIN_SECONDS  # rendered, and the processes' default
    # Longer than httpx's idle expiry: by the end of the window a kept-alive connection was reused or dropped.
    assert (httpx.Limits().keepalive_expiry or 0) < DRAIN_SECONDS
    parser = argparse.ArgumentParser()
    lifecycle.add_drain_arguments(parser)
    assert parser.parse_args([]).drain_seconds == DRAIN_SECONDS
