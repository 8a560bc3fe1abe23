"""ClusterIP Services on this machine: a local 127.x address per Service and a userspace TCP proxy
per Service port (as kube-proxy's userspace mode once did) that spreads connections round robin
over the Service's ready endpoints.

Draining: a terminating pod is never a ready endpoint, so it gets no new connections from the next
sync on, while connections already piped to it run until either side closes them (HTTP keep-alive
included: the server ends those as it drains). As kube-proxy does, when no endpoint is ready, the
terminating ones that still pass readiness ("serving") take the traffic rather than nobody.

Endpoints of Services with a selector are computed here from this node's pods: the API server
refuses loopback addresses in EndpointSlices, so the endpointslice controller cannot list our
127.x pod IPs. The real node's pods (on its bridge) that the EndpointSlices list are backends too, kwok's are not
(nothing answers on their addresses); Services without a selector use their (hand-written) EndpointSlices.

The mapping is written to `<state dir>/services.json`; `service_address()` reads it for the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.devstack.agent.hosts import ServiceView
from loom.devstack.agent.plan import allocate_address
from loom.devstack.cluster.realnode.config import POD_CIDR

# The real node's pod addresses (devstack/cluster/realnode): the only EndpointSlice addresses this host can reach.
REAL_NODE_PODS = ipaddress.ip_network(POD_CIDR)

Obj = dict[str, Any]
log = logging.getLogger("loom.agent.services")
SERVICE_NETWORK = "127.20.0.0/16"


def _default_state_dir() -> Path:
    """Where `loom dev up` keeps the agent's state (LOOM_STATE_DIR or the checkout's .state/)."""
    stack_state = os.environ.get("LOOM_STATE_DIR") or Path(__file__).resolve().parents[2] / ".state"
    return Path(stack_state) / "agent"


def service_address(name: str, namespace: str, state_dir: str | Path | None = None) -> str:
    """The local address that Service `namespace/name` answers on (its ports are the Service ports)."""
    folder = Path(state_dir or os.environ.get("LOOM_AGENT_STATE_DIR") or _default_state_dir())
    mapping = json.loads((folder / "services.json").read_text())
    return str(mapping[f"{namespace}/{name}"]["address"])


def is_headless(service: Obj) -> bool:
    return bool(service["spec"].get("clusterIP") == "None")


def ready_endpoints(slices: list[Obj], port_name: str | None) -> tuple[list[tuple[str, str | None]], int | None]:
    """(ip, hostname) of ready endpoints (else of serving terminating ones) and the target port for the
    named Service port."""
    endpoints: list[tuple[str, str | None]] = []
    fallback: list[tuple[str, str | None]] = []
    target: int | None = None
    for slice_ in slices:
        for port in slice_.get("ports") or []:
            if (port.get("name") or "") == (port_name or "") and port.get("port"):
                target = int(port["port"])
        for endpoint in slice_.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            found = [(ip, endpoint.get("hostname")) for ip in endpoint.get("addresses", [])]
            if conditions.get("ready") is not False:
                endpoints.extend(found)
            elif conditions.get("serving") and conditions.get("terminating"):
                fallback.extend(found)
    return sorted(set(endpoints or fallback)), target


@dataclass(frozen=True)
class PodEndpoint:
    """What endpoint selection needs to know of a pod running here."""

    namespace: str
    labels: dict[str, str]
    ip: str
    ready: bool
    hostname: str | None = None
    subdomain: str | None = None
    ports: dict[str, int] = field(default_factory=dict)  # named container ports
    serving: bool | None = None  # passes readiness whatever its termination (None: same as ready)
    terminating: bool = False

    @property
    def drain_target(self) -> bool:
        """Terminating but still serving: an endpoint only while no other is ready."""
        return self.terminating and bool(self.ready if self.serving is None else self.serving)


def named_ports(pod_spec: Obj) -> dict[str, int]:
    return {
        p["name"]: int(p["containerPort"])
        for c in pod_spec.get("containers") or []
        for p in c.get("ports") or []
        if p.get("name")
    }


def api_endpoints(pods: list[Obj]) -> list[PodEndpoint]:
    """Endpoints as the API server last heard of them (Ready condition): used before this agent
    runs the pods itself, while it takes over from a previous agent."""
    endpoints = []
    for pod in pods:
        status, meta, spec = pod.get("status") or {}, pod["metadata"], pod["spec"]
        if not status.get("podIP"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        terminating = bool(meta.get("deletionTimestamp"))
        endpoints.append(
            PodEndpoint(
                meta["namespace"],
                meta.get("labels") or {},
                status["podIP"],
                ready and not terminating,
                spec.get("hostname"),
                spec.get("subdomain"),
                named_ports(spec),
                serving=ready,
                terminating=terminating,
            )
        )
    return endpoints


def selected_pods(service: Obj, pods: list[PodEndpoint]) -> list[PodEndpoint]:
    selector: dict[str, str] = service["spec"].get("selector") or {}
    namespace = service["metadata"]["namespace"]
    return [p for p in pods if p.namespace == namespace and all(p.labels.get(k) == v for k, v in selector.items())]


def target_port(port: Obj, pod: PodEndpoint) -> int | None:
    target: Any = port.get("targetPort", port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    return pod.ports.get(str(target))


def pod_backends(service: Obj, port: Obj, pods: list[PodEndpoint]) -> list[tuple[str, int]]:
    """(ip, port) of the ready pods behind one Service port; while none is ready, of the terminating
    pods that still serve (kube-proxy's fallback: a last replica draining still answers)."""
    backends, draining = [], []
    for pod in selected_pods(service, pods):
        number = target_port(port, pod)
        if number is None:
            continue
        if pod.ready:
            backends.append((pod.ip, number))
        elif pod.drain_target:
            draining.append((pod.ip, number))
    return sorted(backends or draining)


def service_backends(service: Obj, port: Obj, slices: list[Obj], pods: list[PodEndpoint]) -> list[tuple[str, int]]:
    """(ip, port) behind one Service port: this agent's own pods the selector picks, and the ready endpoints the
    Service's EndpointSlices list on the stack's real node (a routable address on its bridge, in REAL_NODE_PODS). Kwok's
    pods are in the slices too, with addresses nothing answers on: left out, as before the real node. A Service
    without a selector has only its slices, all of them (hand-written endpoints)."""
    endpoints, target = ready_endpoints(slices, port.get("name"))
    if not service["spec"].get("selector"):
        return sorted((ip, target) for ip, _ in endpoints) if target else []
    local = pod_backends(service, port, pods)
    on_the_real_node = [(ip, target) for ip, _ in endpoints if target and _in_real_node_pods(ip)]
    return sorted(set(local) | set(on_the_real_node))


def _in_real_node_pods(address: str) -> bool:
    try:
        return ipaddress.ip_address(address) in REAL_NODE_PODS
    except ValueError:
        return False


def headless_endpoints(service: Obj, pods: list[PodEndpoint]) -> list[tuple[str, str | None]]:
    """(ip, hostname) records of a headless Service: hostname only where subdomain names it."""
    publish_all = bool(service["spec"].get("publishNotReadyAddresses"))
    name = service["metadata"]["name"]
    return sorted(
        (p.ip, p.hostname if p.subdomain == name else None)
        for p in selected_pods(service, pods)
        if p.ready or publish_all
    )


class PortProxy:
    """Accepts on (address, port) and pipes each connection to the next ready backend."""

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self.backends: list[tuple[str, int]] = []
        self._turn = itertools.count()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()  # strong refs; cancelled when the Service goes

    async def start(self) -> None:
        # reuse_port: during an agent hand-over the old and the new agent listen side by side.
        self._server = await asyncio.start_server(
            self._handle, self.address, self.port, reuse_address=True, reuse_port=True
        )

    async def close(self, drain_seconds: float = 0.0) -> None:
        """Stop accepting; connections in flight get `drain_seconds` to finish, then are cut."""
        if self._server is not None:
            self._server.close()
            if self._connections and drain_seconds > 0:
                await asyncio.wait(list(self._connections), timeout=drain_seconds)
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        backends = list(self.backends)
        upstream = None
        if backends:
            start = next(self._turn)
            for i in range(len(backends)):  # a backend that refuses gets skipped, as kube-proxy retried
                host, port = backends[(start + i) % len(backends)]
                try:
                    upstream = await asyncio.wait_for(asyncio.open_connection(host, port), 3)
                    break
                except (TimeoutError, OSError):
                    continue
        if upstream is None:
            writer.close()
            return
        up_reader, up_writer = upstream
        try:
            await asyncio.gather(
                _pipe(reader, up_writer, writer), _pipe(up_reader, writer, up_writer), return_exceptions=True
            )
        finally:
            for end in (writer, up_writer):
                end.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, other: asyncio.StreamWriter) -> None:
    """Copy one direction; a half-close is passed on, a reset tears down both directions."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
        other.close()


@dataclass
class ServiceEntry:
    address: str
    ports: dict[int, PortProxy]
    cluster_ip: str | None = None  # the API server's egress proxy maps it to `address` (cluster/egress.py)


class ServiceTable:
    """Keeps one address and proxies per ClusterIP Service in step with the API objects."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "services.json"
        self.entries: dict[str, ServiceEntry] = {}
        self.views: list[ServiceView] = []
        self._unusable: set[str] = set()  # addresses someone else holds a port on
        try:
            self._addresses: dict[str, str] = {
                key: value["address"] for key, value in json.loads(self.path.read_text()).items()
            }
        except (OSError, ValueError):
            self._addresses = {}

    async def sync(
        self, services: list[Obj], slices: list[Obj], pods: list[PodEndpoint], move_when_taken: bool = True
    ) -> None:
        """Bring addresses and proxies in line; an address found taken is given up for another one
        unless `move_when_taken` is off (warm-up: the previous agent still holds it, without reuse_port)."""
        by_service: dict[str, list[Obj]] = {}
        for slice_ in slices:
            owner = (slice_["metadata"].get("labels") or {}).get("kubernetes.io/service-name")
            if owner:
                by_service.setdefault(f"{slice_['metadata']['namespace']}/{owner}", []).append(slice_)
        views: list[ServiceView] = []
        wanted: set[str] = set()
        for service in services:
            meta, spec = service["metadata"], service["spec"]
            key = f"{meta['namespace']}/{meta['name']}"
            if spec.get("type") == "ExternalName":
                continue
            own_slices = by_service.get(key, [])
            if is_headless(service):
                if spec.get("selector"):
                    endpoints = headless_endpoints(service, pods)
                else:
                    endpoints, _ = ready_endpoints(own_slices, None)
                views.append(ServiceView(meta["name"], meta["namespace"], None, tuple(endpoints)))
                continue
            wanted.add(key)
            for _ in range(3):  # an address found taken is abandoned and another one tried
                entry = await self._ensure(key)
                entry.cluster_ip = spec.get("clusterIP")
                await self._sync_ports(entry, service, own_slices, pods, move_when_taken)
                if key in self.entries:
                    break
            views.append(ServiceView(meta["name"], meta["namespace"], entry.address))
        for key in set(self.entries) - wanted:
            for proxy in self.entries.pop(key).ports.values():
                await proxy.close()
        self._addresses = {k: v for k, v in self._addresses.items() if k in wanted}
        self.views = views
        self._save()

    async def _ensure(self, key: str) -> ServiceEntry:
        if key not in self.entries:
            # Salted with the state dir: two agents on one machine (two stacks) pick different spots.
            address = self._addresses.get(key) or allocate_address(
                SERVICE_NETWORK, set(self._addresses.values()) | self._unusable, f"{self.path}:{key}"
            )
            self._addresses[key] = address
            self.entries[key] = ServiceEntry(address, {})
        return self.entries[key]

    async def _sync_ports(
        self, entry: ServiceEntry, service: Obj, slices: list[Obj], pods: list[PodEndpoint], move_when_taken: bool
    ) -> None:
        ports = service["spec"].get("ports") or []
        wanted = {int(p["port"]): p for p in ports if p.get("protocol", "TCP") == "TCP"}
        for number in set(entry.ports) - set(wanted):
            await entry.ports.pop(number).close()
        for number, port in wanted.items():
            if number not in entry.ports:
                proxy = PortProxy(entry.address, number)
                try:
                    await proxy.start()
                except OSError as exc:
                    if not move_when_taken:
                        continue
                    log.warning("cannot listen on %s:%s (%s): moving the Service elsewhere", entry.address, number, exc)
                    await self._abandon(entry)
                    return
                entry.ports[number] = proxy
            entry.ports[number].backends = service_backends(service, port, slices, pods)

    async def _abandon(self, entry: ServiceEntry) -> None:
        """Give up an address another program holds; the next sync allocates a fresh one."""
        self._unusable.add(entry.address)
        for key in [k for k, e in self.entries.items() if e is entry]:
            del self.entries[key]
            self._addresses.pop(key, None)
        for proxy in entry.ports.values():
            await proxy.close()

    def _save(self) -> None:
        mapping = {
            key: {"address": entry.address, "ports": sorted(entry.ports), "clusterIP": entry.cluster_ip}
            for key, entry in self.entries.items()
        }
        partial = self.path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(mapping, indent=1, sort_keys=True))
        partial.replace(self.path)

    async def close(self, drain_seconds: float = 0.0) -> None:
        proxies = [proxy for entry in self.entries.values() for proxy in entry.ports.values()]
        await asyncio.gather(*(proxy.close(drain_seconds) for proxy in proxies))
        self.entries.clear()
