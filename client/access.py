"""How the SDK reaches a Service of the cluster (a model server, MLflow) from where it runs.

Objects report in-cluster URLs (`http://<service>.<namespace>.svc`). Inside a pod they are reachable as they
are (`InCluster`). Outside, `PortForward` (the default there) opens a local port that the API server forwards to
a ready pod behind the Service, as `kubectl port-forward service/...` does, for as long as the `with` block lasts.
`Direct` maps a Service to an address the caller can reach some other way (a LoadBalancer, an ingress, or the
local stack's node agent, which gives every Service a local address and has no port-forward).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from .kube import Connection, NotFound, in_cluster


@dataclass(frozen=True)
class ServiceUrl:
    """An in-cluster URL split into the Service it names and the rest."""

    scheme: str
    name: str
    namespace: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str, default_namespace: str = "default") -> ServiceUrl | None:
        """`http://svc.ns.svc[.cluster.local][:port]/path` (or `http://svc[.ns]:port`) -> its parts; None for a URL
        that names no Service (an external host)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        labels = host.split(".")
        if host.endswith(".svc") or host.endswith(".svc.cluster.local"):
            if len(labels) < 3:
                return None
            name, namespace = labels[0], labels[1]
        elif "." not in host and host and host != "localhost":
            name, namespace = host, default_namespace
        elif len(labels) == 2 and not labels[1].isdigit():
            name, namespace = labels
        else:
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = urlunsplit(("", "", parts.path, parts.query, parts.fragment))
        return cls(parts.scheme or "http", name, namespace, port, path)

    def with_address(self, host: str, port: int) -> str:
        return f"{self.scheme}://{host}:{port}{self.path}".rstrip("/")


class ServiceAccess(Protocol):
    def open(self, url: str) -> contextlib.AbstractContextManager[str]:
        """A URL the caller can reach for the in-cluster `url`, valid inside the `with` block."""
        ...


class InCluster:
    """Inside the cluster: Service URLs work as they are."""

    @contextlib.contextmanager
    def open(self, url: str) -> Iterator[str]:
        yield url.rstrip("/")


@dataclass(frozen=True)
class Direct:
    """Reach Services at the address `resolve(name, namespace)` returns (the Service's own ports), e.g. an ingress's
    or the local stack's (`loom.devstack.agent.service_address`). URLs that name no Service pass unchanged."""

    resolve: Callable[[str, str], str]

    @contextlib.contextmanager
    def open(self, url: str) -> Iterator[str]:
        target = ServiceUrl.parse(url)
        if target is None:
            yield url.rstrip("/")
            return
        yield target.with_address(self.resolve(target.name, target.namespace), target.port)


class PortForwardRefused(ConnectionError):
    """The API server or the pod's node would not forward a port to the pod (the message says which and why)."""


class PortForward:
    """Outside the cluster: a local port forwarded through the API server to a ready pod behind the Service.

    `open` forwards one connection before it hands out the local port: a node that serves no port-forward (a
    virtual node, a node agent) or a caller without the `pods/portforward` permission is a PortForwardRefused with
    the reason there, not a connection reset on the caller's first request."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def _pod_and_port(self, target: ServiceUrl) -> tuple[str, int]:
        """A ready pod behind the Service and the container port its `target.port` leads to."""
        service = self.connection.call("GET", f"/api/v1/namespaces/{target.namespace}/services/{target.name}")
        ports = service.get("spec", {}).get("ports") or []
        entry = next((p for p in ports if int(p.get("port", 0)) == target.port), None)
        if entry is None:
            raise NotFound(404, f"Service {target.namespace}/{target.name} has no port {target.port}")
        selector = service.get("spec", {}).get("selector") or {}
        if not selector:
            raise NotFound(404, f"Service {target.namespace}/{target.name} selects no pods to forward to")
        labels = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = self.connection.call(
            "GET", f"/api/v1/namespaces/{target.namespace}/pods", query=[("labelSelector", labels)]
        ).get("items", [])
        ready = [p for p in pods if _ready(p)]
        if not ready:
            raise NotFound(404, f"no ready pod behind Service {target.namespace}/{target.name} to forward to")
        pod = sorted(ready, key=lambda p: p["metadata"]["name"])[0]
        return pod["metadata"]["name"], _container_port(pod, entry.get("targetPort", target.port))

    @contextlib.contextmanager
    def open(self, url: str) -> Iterator[str]:
        target = ServiceUrl.parse(url, self.connection.namespace)
        if target is None:
            yield url.rstrip("/")
            return
        pod, port = self._pod_and_port(target)
        try:
            self._pod_socket(target.namespace, pod, port).close()
        except Exception as exc:
            raise PortForwardRefused(
                f"cannot port-forward to pod {target.namespace}/{pod} port {port} for Service {target.name}: "
                f"{_reason(exc)}. Reach the Service another way: Client(access=Direct(...)) with an address you "
                f"can reach (an ingress, a LoadBalancer), or the CLI's --url"
            ) from exc
        forwarder = Forwarder(lambda: self._pod_socket(target.namespace, pod, port))
        with forwarder:
            yield target.with_address("127.0.0.1", forwarder.port)

    def _pod_socket(self, namespace: str, pod: str, port: int) -> socket.socket:
        from kubernetes import client as k8s
        from kubernetes.stream import portforward

        core = k8s.CoreV1Api(self.connection.api)
        forward = portforward(core.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port))
        sock: socket.socket = forward.socket(port)
        sock.setblocking(True)
        return sock


class Forwarder:
    """A local listening socket; each accepted connection is piped both ways to a socket `connect()` opens."""

    def __init__(self, connect: Callable[[], socket.socket]) -> None:
        self._connect = connect
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Forwarder:
        thread = threading.Thread(target=self._accept, name="loom-forward-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._closed.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                local, _ = self._listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._pipe, args=(local,), name="loom-forward", daemon=True)
            thread.start()

    def _pipe(self, local: socket.socket) -> None:
        try:
            remote = self._connect()
        except Exception:
            local.close()
            return
        sockets = [local, remote]
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select(sockets, [], [], 0.5)
                for source in readable:
                    data = source.recv(65536)
                    if not data:
                        return
                    (remote if source is local else local).sendall(data)
        except OSError:
            return
        finally:
            local.close()
            remote.close()


def _reason(exc: BaseException) -> str:
    """What a failed forward says, without the client's multi-line HTTP dump."""
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status is not None:
        return f"the API server answered {status} {reason or ''}".rstrip()
    # Past the API server: the pod's node (its kubelet) never opened the stream; the client's own words vary.
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"the pod's node did not open the forward ({detail})"


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _container_port(pod: dict[str, Any], target: int | str) -> int:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    raise NotFound(404, f"pod {pod['metadata']['name']} has no port named {target}")


def default_access(connection: Connection) -> ServiceAccess:
    return InCluster() if in_cluster() else PortForward(connection)
