"""The stack's egress proxy: the API server's CONNECT to a Service's ClusterIP reaches the agent's address."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loom.devstack.cluster.components import egress_selector_config
from loom.devstack.cluster.egress import parse_connect, resolve, serve

SERVICES = {"ns/hook": {"address": "127.20.1.2", "clusterIP": "10.96.0.7", "ports": [443]}}


def test_connect_targets_are_parsed_and_bad_requests_refused() -> None:
    assert parse_connect(b"CONNECT 10.96.0.7:443 HTTP/1.1\r\nHost: x\r\n\r\n") == ("10.96.0.7", 443)
    assert parse_connect(b"CONNECT [::1]:10250 HTTP/1.1\r\n\r\n") == ("::1", 10250)
    for head in (b"GET / HTTP/1.1\r\n\r\n", b"CONNECT nohost HTTP/1.1\r\n\r\n", b"CONNECT a:b HTTP/1.1\r\n\r\n"):
        with pytest.raises(ValueError):
            parse_connect(head)


def test_a_cluster_ip_goes_to_the_agents_address_and_anything_else_as_asked() -> None:
    assert resolve("10.96.0.7", 443, SERVICES) == ("127.20.1.2", 443)
    assert resolve("10.96.0.7", 80, SERVICES) == ("10.96.0.7", 80)  # not a port of that Service
    assert resolve("127.0.0.1", 10250, SERVICES) == ("127.0.0.1", 10250)  # a kubelet


def test_a_host_service_maps_its_port_and_wins_over_the_agents_entry(tmp_path: Path) -> None:
    from loom.devstack.cluster.egress import _load

    host = {
        "kueue-system/hook": {
            "address": "127.0.0.1",
            "clusterIP": "10.96.0.9",
            "ports": [443],
            "targetPorts": {"443": 40123},
        }
    }
    agent = {"kueue-system/hook": {"address": "127.20.1.9", "clusterIP": "10.96.0.9", "ports": [443]}, **SERVICES}
    (tmp_path / "host.json").write_text(json.dumps(host))
    (tmp_path / "agent.json").write_text(json.dumps(agent))
    merged = _load([tmp_path / "host.json", tmp_path / "agent.json"])
    assert resolve("10.96.0.9", 443, merged) == ("127.0.0.1", 40123)
    assert resolve("10.96.0.7", 443, merged) == ("127.20.1.2", 443)


def test_the_api_server_config_sends_cluster_traffic_to_the_socket(tmp_path: Path) -> None:
    config = egress_selector_config(tmp_path / "egress.sock")
    [selection] = config["egressSelections"]
    assert selection["name"] == "cluster"
    assert selection["connection"] == {
        "proxyProtocol": "HTTPConnect",
        "transport": {"uds": {"udsName": str(tmp_path / "egress.sock")}},
    }


def test_a_tunnel_carries_bytes_both_ways(tmp_path: Path) -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"echo:" + await reader.readexactly(5))
            await writer.drain()
            writer.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = upstream.sockets[0].getsockname()[1]
        services = tmp_path / "services.json"
        services.write_text(json.dumps({"ns/s": {"address": "127.0.0.1", "clusterIP": "10.96.9.9", "ports": [port]}}))
        socket_path = tmp_path / "egress.sock"
        proxy = asyncio.create_task(serve(socket_path, [tmp_path / "absent.json", services]))
        while not socket_path.exists():
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        writer.write(f"CONNECT 10.96.9.9:{port} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        status = await reader.readuntil(b"\r\n\r\n")
        writer.write(b"hello")
        body = await reader.read()
        writer.close()
        proxy.cancel()
        upstream.close()
        return status, body

    status, body = asyncio.run(scenario())
    assert status.startswith(b"HTTP/1.1 200") and body == b"echo:hello"
