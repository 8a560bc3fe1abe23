"""The operator's connections to the API server: opened before the first burst needs them, and kept open across a
quiet minute (client.WARM_CONNECTIONS says what a new HTTPS connection cost a burst of TrainingJobs)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.config import kube_config

from loom.operator.core import client

pytestmark = pytest.mark.timeout(30)


async def test_the_warm_up_sends_its_requests_at_once_so_each_opens_a_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_flight, most, paths = 0, 0, []

    async def fake_call(method: str, path: str, **_: Any) -> dict[str, Any]:
        nonlocal in_flight, most
        paths.append((method, path))
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)  # an open request holds its connection
        in_flight -= 1
        return {"major": "1"}

    monkeypatch.setattr(client, "_call", fake_call)
    assert await client.warm_up(8) == 8
    assert paths == [("GET", "/version")] * 8 and most == 8


async def test_a_failed_warm_up_request_is_counted_and_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    async def flaky_call(method: str, path: str, **_: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise client.aiohttp.ClientConnectionError("connection refused")
        return {}

    monkeypatch.setattr(client, "_call", flaky_call)
    with caplog.at_level("INFO", logger="loom.kube"):
        assert await client.warm_up(4) == 2
    assert "2 of 4 warm-up requests to the API server failed: connection refused" in caplog.text


async def test_the_client_keeps_idle_connections_for_a_minute_within_its_connection_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    # Where load_kube_config looks (read from $KUBECONFIG once, at its import).
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(variable, raising=False)
    api = await client.api_client()
    try:
        connector = api.rest_client.pool_manager.connector
        assert connector is not None
        assert connector.limit == client.KUBE_CONNECTIONS >= client.WARM_CONNECTIONS
        # aiohttp's own name for it: an upgrade that renames it fails here rather than falling back to 15 s.
        assert connector._keepalive_timeout == client.KEEPALIVE_S == 60.0
    finally:
        await client.close()
