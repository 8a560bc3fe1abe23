"""The kube layer's calls neither hang nor queue behind each other: every request has a deadline, and the calls of
passes for many objects run at once (the operator-churn chaos test once saw every InferenceService pass abandoned
before its status write, under load, on a 2-core machine whose asyncio thread pool had 6 threads; the client is
async now, with no pool, and this holds it so)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import kubernetes_asyncio
import pytest

from loom.operator.core import client as kube

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_api_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An API server address that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    configuration = kubernetes_asyncio.client.Configuration()
    configuration.host = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def api_client() -> kubernetes_asyncio.client.ApiClient:
        return kubernetes_asyncio.client.ApiClient(configuration)

    monkeypatch.setattr(kube, "api_client", api_client)
    monkeypatch.setattr(kube, "READ_TIMEOUT_S", 0.5)
    yield configuration.host
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


async def test_a_request_the_api_server_never_answers_fails_instead_of_hanging(silent_api_server: str) -> None:
    with pytest.raises(kube.REQUEST_ERRORS) as raised:
        await kube.get("v1", "ConfigMap", "ml", "bot-config")
    assert isinstance(raised.value, TimeoutError), repr(raised.value)


async def test_the_calls_of_many_passes_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 calls that each wait until all 24 are in flight: they finish only if nothing holds some of them back.
    together = asyncio.Barrier(24)

    async def call(method: str, path: str, **_: Any) -> dict[str, Any]:
        await asyncio.wait_for(together.wait(), 20)
        return {"metadata": {"name": path.rsplit("/", 1)[-1]}}

    monkeypatch.setattr(kube, "_call", call)
    names = [f"svc{i}" for i in range(24)]
    got = await asyncio.gather(*(kube.get("v1", "ConfigMap", "ml", name) for name in names))
    assert [obj["metadata"]["name"] for obj in got if obj is not None] == names
