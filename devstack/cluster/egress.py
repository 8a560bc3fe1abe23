"""The API server's way into the local stack's cluster network: an HTTP CONNECT proxy on a Unix socket.

The API server's egress selector (`--egress-selector-config-file`, the mechanism real clusters use when the
control plane cannot route to the cluster network, e.g. through konnectivity) sends its `cluster` traffic
here: admission webhooks and aggregated APIs called through a Service, and its kubelet connections (logs).

Why it is needed: the API server resolves a webhook's Service to the Service's ClusterIP, and nothing on this
machine routes 10.96.0.0/16 (there is no kube-proxy); the node agent serves every ClusterIP Service on a local
127.20.x address instead. `--enable-aggregator-routing` (dial an endpoint) does not help either: EndpointSlices
cannot hold the agent's loopback pod addresses. So `CONNECT <clusterIP>:<port>` is sent to the agent's address of
that Service (from the agent's `services.json`, which records each Service's ClusterIP); any other target (a
kubelet endpoint, a pod address) is dialled as asked.

    python -m loom.devstack.cluster.egress --socket <path> --services <agent state>/services.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("loom.stack.egress")
CONNECT_TIMEOUT_S = 5.0
HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16384


def parse_connect(head: bytes) -> tuple[str, int]:
    """(host, port) of a `CONNECT host:port HTTP/1.1` request head; ValueError for anything else."""
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = request_line.split(" ")
    if len(parts) != 3 or parts[0] != "CONNECT":
        raise ValueError(f"not a CONNECT request: {request_line!r}")
    host, sep, port = parts[1].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"CONNECT target must be host:port, got {parts[1]!r}")
    return host.strip("[]"), int(port)


def resolve(host: str, port: int, services: Mapping[str, Any]) -> tuple[str, int]:
    """Where to dial: a Service's ClusterIP becomes the agent's address for it (same port, unless the entry maps
    the port: a Service served by a host process of the stack, such as Kueue's webhooks); others as asked."""
    for entry in services.values():
        if entry.get("clusterIP") == host and port in entry.get("ports", [port]):
            return str(entry["address"]), int((entry.get("targetPorts") or {}).get(str(port), port))
    return host, port


def _load(services_files: list[Path]) -> dict[str, Any]:
    """The Services of every file; the first file naming a Service wins (host services before the agent's)."""
    merged: dict[str, Any] = {}
    for services_file in services_files:
        try:
            found = dict(json.loads(services_file.read_text()))
        except (OSError, ValueError):
            continue  # no agent (yet), no host service: only direct targets resolve
        merged = {**found, **merged}
    return merged


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, services_files: list[Path]) -> None:
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
        if len(head) > MAX_HEADER_BYTES:
            raise ValueError("request head too large")
        host, port = parse_connect(head)
        target = resolve(host, port, _load(services_files))
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(*target), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            log.warning("CONNECT %s:%s (dialled %s:%s) failed: %s", host, port, *target, exc)
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        up_reader, up_writer = upstream
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
        log.warning("bad request: %s", exc)
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    except (ConnectionError, OSError):
        pass
    finally:
        for end in (writer, upstream[1] if upstream else None):
            if end is not None:
                end.close()


async def serve(socket_path: Path, services_files: list[Path]) -> None:
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)  # left by a previous run
    server = await asyncio.start_unix_server(lambda r, w: _handle(r, w, services_files), path=str(socket_path))
    os.chmod(socket_path, 0o600)  # only this user (the API server runs as it) may tunnel into the stack
    log.info("egress proxy on %s (Services from %s)", socket_path, ", ".join(map(str, services_files)))
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument(
        "--services",
        type=Path,
        action="append",
        required=True,
        help="a services.json (repeatable: the stack's host services, then the node agent's)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.socket, args.services))


if __name__ == "__main__":
    main()
