"""The operator's own HTTP servers answer their own paths only (#52 part 3).

prometheus_client's start_http_server answers every path with 200 and the metrics text: on the node agent, a pod's
LLM front probing 127.0.0.1:8081/v1/models for its engine reached the host's `loom operator` metrics server and got
a 200. The metrics server (observability.serve_metrics) now serves /metrics and 404s elsewhere; Kopf's liveness
server serves its one path (held here so a Kopf release that widens it fails this test)."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from typing import Any, cast

import kopf
import pytest
from kopf._core.engines import probing
from prometheus_client import CollectorRegistry, Counter

from loom.operator.core.observability import serve_metrics

pytestmark = pytest.mark.timeout(30)


def status_of(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_metrics_server_serves_metrics_and_404s_every_other_path() -> None:
    registry = CollectorRegistry()
    Counter("loom_test_paths", "a test counter", registry=registry).inc()
    server = serve_metrics(0, "127.0.0.1", registry=registry)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        code, body = status_of(f"{base}/metrics")
        assert code == 200 and "loom_test_paths_total 1.0" in body
        for path in ("/", "/health", "/healthz", "/v1/models", "/metrics/extra", "/anything?x=1"):
            code, body = status_of(base + path)
            assert code == 404, (path, code, body[:80])
            assert "loom_test_paths" not in body
    finally:
        server.shutdown()
        server.server_close()


def test_the_metrics_server_binds_ipv6_hosts() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        server = serve_metrics(0, "::1", registry=CollectorRegistry())
    except OSError as error:
        pytest.skip(f"no IPv6 loopback here: {error}")
    try:
        assert status_of(f"http://[::1]:{server.server_port}/metrics")[0] == 200
        assert status_of(f"http://[::1]:{server.server_port}/v1/models")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_the_liveness_server_404s_every_path_but_its_own() -> None:
    port = free_port()

    async def scenario() -> list[int]:
        ready = asyncio.Event()
        task = asyncio.create_task(
            probing.health_reporter(
                f"http://127.0.0.1:{port}/healthz",
                memo=kopf.Memo(),
                indices=cast(Any, {}),  # no index handlers are registered
                registry=kopf.OperatorRegistry(),
                settings=kopf.OperatorSettings(),
                ready_flag=ready,
            )
        )
        try:
            await asyncio.wait_for(ready.wait(), 10)
            paths = ("/healthz", "/metrics", "/v1/models", "/health", "/")
            return [await asyncio.to_thread(lambda p=p: status_of(f"http://127.0.0.1:{port}{p}")[0]) for p in paths]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(scenario()) == [200, 404, 404, 404, 404]
