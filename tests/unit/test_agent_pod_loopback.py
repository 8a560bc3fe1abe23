"""A pod on the node agent does not reach the host's loopback listeners (#52 part 3).

A real pod's 127.0.0.1 is its own network namespace's. On the agent pods share the host's, and an LLM front probing
127.0.0.1:8081 for its engine reached the host's `loom operator` metrics server. The agent's shim (shim.py) refuses
a TCP connect to 127.0.0.1 / ::1 / the pod's own address on a port the pod does not listen on, unless the host port
is published to pods (LOOM_HOST_PORTS, or a file in LOOM_HOST_PORTS_DIR). Real processes, the real compiled shim."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from loom.devstack.agent.shim import build_shim, host_ports_environment, published_host_port

pytestmark = pytest.mark.timeout(120)

# Connects as a pod's process would, and prints what happened: the server's greeting, or the error's name.
CLIENT = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    with socket.create_connection((host, port), timeout=5) as conn:
        print(conn.recv(32).decode() or "empty")
except OSError as error:
    print(type(error).__name__)
"""

SERVER_IN_POD = """
import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("0.0.0.0", int(sys.argv[1])))
sock.listen(8)
print("ready", flush=True)
while True:
    conn, _ = sock.accept()
    conn.sendall(b"pod")
    conn.close()
"""


@contextmanager
def host_listener(host: str = "127.0.0.1") -> Iterator[int]:
    """A host process's server (the operator's metrics server, say) on a loopback port: answers 'host'."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.bind((host, 0))
    sock.listen(16)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"host")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        sock.close()


def in_pod(shim: Path, pod_ip: str, host: str, port: int, extra: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_HOST_PORTS")}
    env.update({"LD_PRELOAD": str(shim), "LOOM_POD_IP": pod_ip, **(extra or {})})
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, host, str(port)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_pod_is_refused_on_a_host_loopback_port_it_does_not_own(tmp_path: Path) -> None:
    shim = build_shim(tmp_path)
    with host_listener() as port:
        # The host itself reaches it; a pod does not, by any loopback name of it.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            assert conn.recv(8) == b"host"
        assert in_pod(shim, "127.10.202.1", "127.0.0.1", port) == "ConnectionRefusedError"
        assert in_pod(shim, "127.10.202.1", "localhost", port) == "ConnectionRefusedError"


def test_a_pod_is_refused_on_ipv6_loopback_and_its_own_address_without_a_listener(tmp_path: Path) -> None:
    shim = build_shim(tmp_path)
    with host_listener("0.0.0.0") as port:  # a host server on every address: also on the pod's 127.10.x.y
        assert in_pod(shim, "127.10.202.2", "127.10.202.2", port) == "ConnectionRefusedError"
        assert in_pod(shim, "127.10.202.2", "127.0.0.1", port) == "ConnectionRefusedError"
    try:
        context = host_listener("::1")
        port = context.__enter__()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert in_pod(shim, "127.10.202.2", "::1", port) == "ConnectionRefusedError"
    finally:
        context.__exit__(None, None, None)


def test_the_pods_own_listener_on_that_port_is_the_one_it_reaches(tmp_path: Path) -> None:
    shim = build_shim(tmp_path)
    with host_listener() as port:
        env = {**os.environ, "LD_PRELOAD": str(shim), "LOOM_POD_IP": "127.10.202.3"}
        server = subprocess.Popen([sys.executable, "-c", SERVER_IN_POD, str(port)], env=env, stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
            assert in_pod(shim, "127.10.202.3", "127.0.0.1", port) == "pod"
            assert in_pod(shim, "127.10.202.4", "127.0.0.1", port) == "ConnectionRefusedError"  # another pod
        finally:
            server.kill()
            server.wait()


def test_published_host_ports_stay_reachable(tmp_path: Path) -> None:
    """The API server's port (in-cluster clients reach it on loopback) and ports published in the state dir."""
    shim = build_shim(tmp_path)
    with host_listener() as api_port, host_listener() as backing_port:
        env = host_ports_environment(tmp_path, "127.0.0.1", api_port)
        assert env["LOOM_HOST_PORTS"] == str(api_port)
        assert in_pod(shim, "127.10.202.5", "127.0.0.1", api_port, env) == "host"
        assert in_pod(shim, "127.10.202.5", "127.0.0.1", backing_port, env) == "ConnectionRefusedError"
        with published_host_port(tmp_path, backing_port):
            assert in_pod(shim, "127.10.202.5", "127.0.0.1", backing_port, env) == "host"
        assert in_pod(shim, "127.10.202.5", "127.0.0.1", backing_port, env) == "ConnectionRefusedError"
    assert "LOOM_HOST_PORTS" not in host_ports_environment(tmp_path, "10.0.0.1", 6443)  # not on loopback


def test_udp_to_loopback_is_left_alone(tmp_path: Path) -> None:
    """A resolver on 127.0.0.1:53 (UDP) must keep answering pods: only TCP connects are refused."""
    shim = build_shim(tmp_path)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        server.settimeout(10)
        port = server.getsockname()[1]
        code = (
            "import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.connect(('127.0.0.1', int(sys.argv[1]))); s.send(b'q'); print('sent')"
        )
        env = {**os.environ, "LD_PRELOAD": str(shim), "LOOM_POD_IP": "127.10.202.6"}
        result = subprocess.run([sys.executable, "-c", code, str(port)], env=env, capture_output=True, text=True)
        assert result.stdout.strip() == "sent", result.stderr
        assert server.recv(8) == b"q"
