"""The node agent's kubelet log endpoint, as the API server calls it for `kubectl logs`."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from loom.devstack.agent.logserver import LogServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_container_logs_tail_previous_and_follow(tmp_path: Path) -> None:
    current, previous = tmp_path / "1.log", tmp_path / "0.log"
    current.write_text("one\ntwo\nthree\n")
    previous.write_text("crashed\n")

    def locate(namespace: str, pod: str, container: str, prev: bool) -> tuple[Path, object] | None:
        if (namespace, pod, container) != ("ns", "web", "server"):
            return None
        return (previous if prev else current), (lambda: False)

    port = _free_port()
    server = LogServer(locate, port, None, None)  # type: ignore[arg-type]
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as http:
            assert (await http.get("/containerLogs/ns/web/server")).text == "one\ntwo\nthree\n"
            assert (await http.get("/containerLogs/ns/web/server?tailLines=2")).text == "two\nthree\n"
            assert (await http.get("/containerLogs/ns/web/server?previous=true")).text == "crashed\n"
            assert (await http.get("/containerLogs/ns/web/server?follow=true")).text == "one\ntwo\nthree\n"
            missing = await http.get("/containerLogs/ns/web/other")
            assert missing.status_code == 404 and "other" in missing.text
    finally:
        await server.stop()
