"""Node agent benchmarks (ratios against baselines measured in the same run, nothing asserted).

1. Service proxy, connections: request/response round trips on fresh connections through the
   agent's userspace Service proxy against the same round trips straight to the backend.
2. Service proxy, bulk: MB/s of one large download through the proxy against a direct download.
3. Container start: starting a process the way the agent does (launcher: unshare, bind mounts,
   hosts file, LD_PRELOAD shim; until the command's pid is recorded) against a plain subprocess.

Needs root (mount namespaces). No cluster:
    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_agent.py [--connections 300] [--megabytes 200]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from loom.devstack.agent.proxies import PortProxy
from loom.devstack.agent.runtime import ContainerProcess
from loom.devstack.agent.shim import build_shim
from loom.devstack.agent.volumes import Mount

BACKEND = """
import socket, sys, threading
size = int(sys.argv[2])
blob = b"x" * (1 << 20)
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], 0)); server.listen(512)
print(server.getsockname()[1], flush=True)
def serve(conn):
    with conn:
        if conn.recv(16) == b"bulk":
            for _ in range(size):
                conn.sendall(blob)
        else:
            conn.sendall(b"pong")
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
BACKEND_IP, PROXY_IP = "127.10.251.1", "127.20.251.1"


def round_trips(host: str, port: int, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        with socket.create_connection((host, port)) as conn:
            conn.sendall(b"ping")
            assert conn.recv(16) == b"pong"
    return count / (time.perf_counter() - started)


def bulk(host: str, port: int, megabytes: int) -> float:
    received = 0
    started = time.perf_counter()
    with socket.create_connection((host, port)) as conn:
        conn.sendall(b"bulk")
        conn.shutdown(socket.SHUT_WR)
        while chunk := conn.recv(1 << 20):
            received += len(chunk)
    assert received == megabytes << 20
    return megabytes / (time.perf_counter() - started)


def start_proxy(backend_port: int) -> tuple[int, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    proxy = PortProxy(PROXY_IP, 0)
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result()
    proxy.backends = [(BACKEND_IP, backend_port)]
    assert proxy._server is not None
    return int(proxy._server.sockets[0].getsockname()[1]), loop


async def container_starts(count: int, state: Path) -> float:
    shim = str(build_shim(state))
    (state / "hosts").write_text("127.0.0.1 localhost\n")
    (state / "vol").mkdir(exist_ok=True)
    started = time.perf_counter()
    for i in range(count):
        proc = ContainerProcess(state / f"c{i}")
        await proc.start(
            ["true"],
            {"PATH": "/usr/bin:/bin", "LD_PRELOAD": shim, "LOOM_POD_IP": BACKEND_IP},
            str(state),
            [Mount(str(state / "vol"), "/mnt/loom-bench")],
            str(state / "hosts"),
            "bench",
            state / f"c{i}.log",
            0,
            "now",
        )
        await proc.wait()
    return count / (time.perf_counter() - started)


def plain_starts(count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        subprocess.run(["true"], check=True)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--starts", type=int, default=20)
    args = parser.parse_args()
    backend = subprocess.Popen(
        [sys.executable, "-c", BACKEND, BACKEND_IP, str(args.megabytes)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert backend.stdout is not None
        backend_port = int(backend.stdout.readline())
        proxy_port, _ = start_proxy(backend_port)
        round_trips(BACKEND_IP, backend_port, 20)  # warm up both paths
        round_trips(PROXY_IP, proxy_port, 20)
        direct_rate = round_trips(BACKEND_IP, backend_port, args.connections)
        proxied_rate = round_trips(PROXY_IP, proxy_port, args.connections)
        direct_mbps = bulk(BACKEND_IP, backend_port, args.megabytes)
        proxied_mbps = bulk(PROXY_IP, proxy_port, args.megabytes)
    finally:
        backend.kill()
        backend.wait()
    with tempfile.TemporaryDirectory() as state:
        agent_rate = asyncio.run(container_starts(args.starts, Path(state)))
    plain_rate = plain_starts(args.starts)
    print(
        f"proxy connections: {proxied_rate:.0f}/s vs direct {direct_rate:.0f}/s -> ratio "
        f"{proxied_rate / direct_rate:.2f}"
    )
    print(
        f"proxy bulk:        {proxied_mbps:.0f} MB/s vs direct {direct_mbps:.0f} MB/s -> ratio "
        f"{proxied_mbps / direct_mbps:.2f}"
    )
    print(
        f"container start:   {agent_rate:.1f}/s vs plain subprocess {plain_rate:.1f}/s -> ratio "
        f"{agent_rate / plain_rate:.3f} ({1000 / agent_rate:.0f} ms per start)"
    )


if __name__ == "__main__":
    main()
