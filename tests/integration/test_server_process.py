"""The server process itself: a model that cannot load stops it (exit 1, reason logged), a separate
metrics port, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loom.devstack.servers import free_port
from loom.workloads.server.testing import child_env, model_server

pytestmark = pytest.mark.timeout(180)


def test_a_model_that_cannot_load_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    config = tmp_path / "server.json"
    config.write_text(json.dumps({
        "modelName": "gpt", "handler": "chargpt", "storageUri": str(tmp_path / "empty"),
        "host": "127.0.0.1", "port": free_port(), "device": "cpu",
    }))
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "loom.workloads.server", "--config", str(config)],
        capture_output=True, text=True, env=child_env(), timeout=150,
    )
    assert result.returncode == 1
    assert "model could not be loaded: FileNotFoundError" in result.stderr


def test_metrics_on_their_own_port_and_a_clean_sigterm(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "server.json"
    config.write_text(json.dumps({
        "modelName": "echo", "handler": "noop", "storageUri": str(tmp_path),
        "host": "127.0.0.1", "port": port, "metricsPort": metrics_port,
    }))
    with model_server(config, tmp_path / "server.log") as url:
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [5]}]}
        assert httpx.post(f"{url}/v2/models/echo/infer", json=body).json()["outputs"][0]["data"] == [5]
        assert httpx.get(f"{url}/metrics").status_code == 404
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'loom_server_requests_total{code="200",endpoint="infer",model="echo"} 1.0' in metrics
    log = (tmp_path / "server.log").read_text()
    assert "Finished server process" in log
    assert "Traceback" not in log
