"""The Node object of this agent: registration, Ready condition and Lease kept fresh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from loom.devstack.agent.config import AgentConfig
from loom.devstack.agent.kubeapi import KubeApi
from loom.devstack.agent.status import now

Obj = dict[str, Any]
log = logging.getLogger("loom.agent.node")
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10.0
AGENT_LABEL = "loom.dev/node-agent"


def capacity(cfg: AgentConfig) -> dict[str, str]:
    return {
        "cpu": cfg.cpu,
        "memory": cfg.memory,
        "pods": str(cfg.max_pods),
        "nvidia.com/gpu": str(cfg.gpus),
        "ephemeral-storage": "100Gi",
    }


def node_status(cfg: AgentConfig, kubelet_version: str) -> Obj:
    stamp = now()

    def condition(kind: str, status: str, reason: str, message: str) -> Obj:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }

    return {
        "capacity": capacity(cfg),
        "allocatable": capacity(cfg),
        "conditions": [
            condition("Ready", "True", "KubeletReady", "loom node agent is posting ready status"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure is tracked"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure is tracked"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "no PID pressure is tracked"),
        ],
        # Hostname first in the API server's default preference: `localhost` makes it resolvable.
        "addresses": [{"type": "InternalIP", "address": cfg.host_ip}, {"type": "Hostname", "address": "localhost"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": cfg.kubelet_port}},
        "nodeInfo": {
            "machineID": _read("/etc/machine-id"),
            "systemUUID": _read("/etc/machine-id"),
            "bootID": _read("/proc/sys/kernel/random/boot_id"),
            "kernelVersion": platform.release(),
            "osImage": "loom node agent (local processes)",
            "containerRuntimeVersion": "loom-process://1",
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine()),
        },
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def lease_body(cfg: AgentConfig) -> Obj:
    renew = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": cfg.node_name, "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": cfg.node_name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": renew},
    }


class NodeKeeper:
    def __init__(self, cfg: AgentConfig, api: KubeApi) -> None:
        self.cfg, self.api = cfg, api
        self.kubelet_version = "v0.0.0"
        self.uid: str | None = None

    async def register(self) -> None:
        version = await self.api.call(client.VersionApi(self.api.api_client).get_code)
        self.kubelet_version = str(version.get("gitVersion", "v0.0.0"))
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.cfg.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.cfg.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": node_status(self.cfg, "")["nodeInfo"]["architecture"],
                    AGENT_LABEL: "true",
                },
            },
            "spec": {},
        }
        try:
            node = await self.api.call(self.api.core.create_node, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            node = await self.api.call(self.api.core.read_node, self.cfg.node_name)
        self.uid = node["metadata"]["uid"]
        await self.heartbeat()

    async def heartbeat(self) -> None:
        await self.api.call(
            self.api.core.patch_node_status, self.cfg.node_name, {"status": node_status(self.cfg, self.kubelet_version)}
        )
        body = lease_body(self.cfg)
        if self.uid:
            body["metadata"]["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": self.cfg.node_name, "uid": self.uid}
            ]
        try:
            await self.api.call(
                self.api.coordination.patch_namespaced_lease,
                self.cfg.node_name,
                "kube-node-lease",
                {"spec": body["spec"]},
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self.api.call(self.api.coordination.create_namespaced_lease, "kube-node-lease", body)

    async def keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            try:
                await self.heartbeat()
            except ApiException as exc:
                if exc.status == 404:  # someone deleted our Node: register it again
                    log.warning("node %s is gone from the API; registering again", self.cfg.node_name)
                    with contextlib.suppress(Exception):
                        await self.register()
                else:
                    log.warning("node heartbeat failed: %s", str(exc).splitlines()[0])
            except Exception as exc:  # the API server may be restarting; try again next beat
                log.warning("node heartbeat failed: %s", exc)
