"""``python -m loom.workloads.router --config <file>``: the pod's command."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import httpx
import pytest

from loom.workloads.router.__main__ import main
from loom.workloads.server.testing import running

pytestmark = pytest.mark.timeout(120)


def test_a_condition_that_does_not_compile_stops_the_router_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "router.json"
    config.write_text(json.dumps({
        "graphName": "g",
        "nodes": {"root": {"routerType": "Switch", "steps": [
            {"serviceName": "a", "name": "pick", "condition": "request.x =="}]}},
        "services": {"a": {"url": "http://a.ns.svc", "modelName": "a"}},
    }))
    assert main(["--config", str(config)]) == 2
    assert "node 'root' step 0 (pick): condition 'request.x =='" in caplog.text


def test_a_graph_that_does_not_validate_stops_the_router(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"graphName": "g", "nodes": {"main": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"}]}}, "services": {"a": {"url": "http://a", "modelName": "a"}}}))
    assert main(["--config", str(config)]) == 2
    assert "a node named 'root'" in caplog.text
    assert main(["--config", str(tmp_path / "missing.json")]) == 2


def test_the_router_process_serves_its_graph(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "router.json"
    config.write_text(json.dumps({
        "graphName": "g", "host": "127.0.0.1", "port": port,
        "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}},
        "services": {"a": {"url": "http://127.0.0.1:9", "modelName": "a"}},
    }))
    argv = [sys.executable, "-m", "loom.workloads.router", "--config", str(config)]
    with running(argv, f"http://127.0.0.1:{port}", tmp_path / "router.log") as url:
        assert httpx.get(f"{url}/v2/models/g").json()["name"] == "g"
        response = httpx.post(f"{url}/v2/models/g/infer", json={"inputs": []})
        assert (response.status_code, response.json()["code"]) == (502, "upstream_unreachable")
