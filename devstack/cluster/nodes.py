"""Simulated GPU nodes: Node objects that kwok keeps Ready and whose pods it pretends to run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

KWOK_NODE_PREFIX = "kwok-node-"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
GPU_RESOURCE = "nvidia.com/gpu"
# What a pod needs in order to land on a kwok node.
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def kwok_placement() -> dict[str, Any]:
    """A pod spec's (or a Loom spec's workers') nodeSelector and tolerations for kwok's simulated nodes, fresh each
    call so that a caller may change its copy."""
    return {"nodeSelector": {"type": "kwok"}, "tolerations": [dict(KWOK_TOLERATION)]}


@dataclass(frozen=True)
class NodeShape:
    count: int = 4
    gpus: int = 8
    cpu: str = "32"
    memory: str = "256Gi"
    pods: str = "110"

    def capacity(self) -> dict[str, str]:
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods}
        if self.gpus:
            capacity[GPU_RESOURCE] = str(self.gpus)
        return capacity


def _manifest(name: str, shape: NodeShape) -> dict[str, Any]:
    labels = {
        "type": "kwok",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
    }
    if shape.gpus:
        # The labels NVIDIA's GPU feature discovery puts on GPU nodes, for node selectors and affinity.
        labels |= {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(shape.gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            # kwok's convention marks the object itself as simulated, next to the label and taint.
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [KWOK_TAINT]},
        # A Node's status may be set on create; kwok's node-initialize stage keeps what it finds.
        "status": {"capacity": shape.capacity(), "allocatable": shape.capacity()},
    }


def ensure_nodes(api: client.ApiClient, shape: NodeShape) -> list[str]:
    """Make exactly `shape.count` kwok nodes exist, with the requested capacity."""
    core = client.CoreV1Api(api)
    wanted = [f"{KWOK_NODE_PREFIX}{i}" for i in range(shape.count)]
    existing = {n.metadata.name: n for n in core.list_node(label_selector="type=kwok").items}
    for name in wanted:
        manifest = _manifest(name, shape)
        node = existing.get(name)
        if node is None:
            try:
                core.create_node(manifest)
            except ApiException as err:
                if err.status != 409:
                    raise
            continue
        core.patch_node(name, {"metadata": {"labels": manifest["metadata"]["labels"]}, "spec": manifest["spec"]})
        if dict(node.status.capacity or {}) != shape.capacity():
            core.patch_node_status(name, {"status": manifest["status"]})
    for name in existing:
        if name.startswith(KWOK_NODE_PREFIX) and name not in wanted:
            core.delete_node(name)
    return wanted


def _ready(node: client.V1Node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def wait_nodes_ready(api: client.ApiClient, names: list[str], timeout: float) -> None:
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while True:
        nodes = {n.metadata.name: n for n in core.list_node(label_selector="type=kwok").items}
        pending = [name for name in names if name not in nodes or not _ready(nodes[name])]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"kwok nodes not Ready after {timeout:.0f}s: {', '.join(pending)} (see the kwok log)")
        time.sleep(0.3)
