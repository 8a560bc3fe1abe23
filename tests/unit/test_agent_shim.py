"""The agent's LD_PRELOAD shim gives each pod its own loopback, as a pod's network namespace does.

Two pods whose servers bind 127.0.0.1 on one port (vLLM's engine behind Loom's front does, on 8081) both get it,
and a client in pod A that connects to 127.0.0.1 reaches A's server, every time. Without it the second pod's
bind fails (EADDRINUSE) and its clients reach the first pod's server: another service's engine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loom.devstack.agent.shim import build_shim

SERVER = """
import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen(64)
print(sock.getsockname()[0], flush=True)
while True:
    conn, _ = sock.accept()
    conn.sendall(sys.argv[2].encode())
    conn.close()
"""

CLIENT = """
import socket, sys
answers = []
for _ in range(int(sys.argv[2])):
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as conn:
        answers.append(conn.recv(16).decode())
print(",".join(answers))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pod_env(shim: Path, pod_ip: str) -> dict[str, str]:
    return {**os.environ, "LD_PRELOAD": str(shim), "LOOM_POD_IP": pod_ip}


@contextmanager
def server_in_pod(shim: Path, pod_ip: str, port: int, name: str) -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), name], env=pod_env(shim, pod_ip), stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()  # the address it really listens on
    finally:
        process.kill()
        process.wait()


def test_each_pod_binds_its_own_loopback_port_and_reaches_its_own_server(tmp_path: Path) -> None:
    shim = build_shim(tmp_path)
    port = free_port()
    with server_in_pod(shim, "127.10.201.1", port, "a") as a, server_in_pod(shim, "127.10.201.2", port, "b") as b:
        assert (a, b) == ("127.10.201.1", "127.10.201.2")
        for pod_ip, name in (("127.10.201.1", "a"), ("127.10.201.2", "b")):
            answers = (
                subprocess.run(
                    [sys.executable, "-c", CLIENT, str(port), "20"],
                    env=pod_env(shim, pod_ip),
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=60,
                )
                .stdout.strip()
                .split(",")
            )
            assert answers == [name] * 20
