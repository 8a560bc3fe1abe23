"""The kube layer's aiohttp session does no per-request work in threads: kubernetes_asyncio turns aiohttp's
`trust_env` on, which reads ~/.netrc and the proxy variables in a worker thread for every request (an eighth of the
operator's CPU in a burst of 200 TrainingJobs, by py-spy). A proxy set in the environment still applies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_asyncio
import pytest

from loom.operator.core import client as kube

pytestmark = pytest.mark.timeout(60)


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        CountingExecutor.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.fixture
def api_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[dict[str, str]]]:
    """A plain-HTTP API server answering every GET with a ConfigMap; yields the headers of each request. A ~/.netrc
    names its host, as a developer's machine might."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(dict(self.headers))
            body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login someone password not-for-the-api-server\n")
    (tmp_path / ".netrc").chmod(0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    configuration = kubernetes_asyncio.client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"

    async def api_client() -> kubernetes_asyncio.client.ApiClient:
        return kube.without_environment_lookups(kubernetes_asyncio.client.ApiClient(configuration))

    monkeypatch.setattr(kube, "api_client", api_client)
    yield seen
    server.shutdown()
    server.server_close()


async def test_requests_run_nothing_in_a_thread_and_send_no_netrc_credentials(api_server: list[dict[str, str]]) -> None:
    asyncio.get_running_loop().set_default_executor(CountingExecutor(max_workers=2))
    CountingExecutor.submitted = 0
    for _ in range(5):
        assert await kube.get("v1", "ConfigMap", "ml", "c") is not None
    assert CountingExecutor.submitted == 0
    assert len(api_server) == 5 and all("Authorization" not in headers for headers in api_server)


async def test_a_proxy_from_the_environment_is_looked_up_once_for_the_api_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def made(host: str) -> Any:
        configuration = kubernetes_asyncio.client.Configuration()
        configuration.host = host
        return kube.without_environment_lookups(kubernetes_asyncio.client.ApiClient(configuration))

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "10.0.0.1")
    proxied, bypassed = made("https://10.96.0.1:443"), made("https://10.0.0.1:6443")
    try:
        assert proxied.rest_client.proxy == "http://proxy.internal:3128"
        assert bypassed.rest_client.proxy is None
        assert not proxied.rest_client.pool_manager.trust_env
    finally:
        await proxied.close()
        await bypassed.close()
