"""Per-pod /etc/hosts: the pod's own names plus Service and headless-Service DNS names.

Rendering is pure. Files are bind-mounted into running pods, so updates rewrite the same inode
(a rename would leave the pod looking at the old file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class ServiceView:
    """What DNS needs to know of a Service."""

    name: str
    namespace: str
    address: str | None  # the local proxy address of a ClusterIP Service; None when headless
    endpoints: tuple[tuple[str, str | None], ...] = field(default=())  # (ip, hostname) ready endpoints


def service_names(name: str, namespace: str, pod_namespace: str) -> list[str]:
    """Names a Service answers to from a pod: short names only within its own namespace."""
    names = [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    if namespace == pod_namespace:
        names.append(name)
    return names


def render_hosts(
    pod_ip: str,
    pod_name: str,
    namespace: str,
    hostname: str | None,
    subdomain: str | None,
    services: list[ServiceView],
) -> str:
    host = hostname or pod_name
    lines = [
        "# Kubernetes-style hosts file written by the loom node agent.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    if subdomain:
        lines.append(f"{pod_ip}\t{host}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}\t{host}")
    else:
        lines.append(f"{pod_ip}\t{host}")
    for svc in sorted(services, key=lambda s: (s.namespace, s.name)):
        names = service_names(svc.name, svc.namespace, namespace)
        if svc.address is not None:
            lines.append(f"{svc.address}\t{' '.join(names)}")
            continue
        for ip, _ in svc.endpoints:
            lines.append(f"{ip}\t{' '.join(names)}")
        for ip, endpoint_host in svc.endpoints:
            if endpoint_host:
                pod_names = [f"{endpoint_host}.{n}" for n in names]
                lines.append(f"{ip}\t{' '.join(pod_names)}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, content: str) -> bool:
    """Rewrite the file's own inode; returns whether anything changed."""
    data = content.encode()
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        path.write_bytes(data)
        return True
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
    return True
