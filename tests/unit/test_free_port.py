"""free_port hands out ports below the kernel's ephemeral range (where outgoing connections and binds to port 0 take
theirs, so a port bound seconds after it was chosen is not taken meanwhile), free, and never twice."""

from __future__ import annotations

import socket
from pathlib import Path

from loom.devstack.servers import PORT_RANGE, free_port


def test_ports_are_below_the_ephemeral_range_free_and_distinct() -> None:
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] and not low <= p <= high for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free: it binds
