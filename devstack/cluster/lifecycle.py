"""Bring the local control plane up, down, and report on it.

`up` is idempotent: components already running with the same command line are left alone, missing
or changed ones are (re)started, and the kwok nodes are reconciled to the requested shape. All
state is under <repo>/.state/stack; binaries come from the build cache (see build.py).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from loom.devstack.cluster import gie, keda, kueue, kwok_crds, lws, procs
from loom.devstack.cluster.build import build, build_node, is_built, node_bin_dir, node_is_built, stack_bin_dir
from loom.devstack.cluster.components import (
    EGRESS_CONFIG,
    EGRESS_SOCKET,
    HOST_SERVICES,
    Component,
    Ports,
    audit_policy,
    control_plane,
    egress_selector_config,
    kubeconfig_path,
    node_agent,
    registry,
    registry_config,
)
from loom.devstack.cluster.components import kueue as kueue_component
from loom.devstack.cluster.components import lws as lws_component
from loom.devstack.cluster.handle import Cluster, StackError
from loom.devstack.cluster.host_webhook import HostWebhookController
from loom.devstack.cluster.nodes import NodeShape, ensure_nodes, wait_nodes_ready
from loom.devstack.cluster.paths import (
    AGENT_STATE_DIR,
    AUDIT_POLICY,
    ETCD_DATA_DIR,
    KUBECONFIG,
    LOCK_FILE,
    PKI_DIR,
    REGISTRY_CONFIG,
    REGISTRY_DATA_DIR,
    STACK_DIR,
    STACK_FILE,
    USERS_DIR,
)
from loom.devstack.cluster.pki import AGENT_NODE_NAME, REAL_NODE_NAME, Pki, ensure_pki
from loom.devstack.cluster.realnode import node as realnode

Progress = Callable[[str], None]
COMPONENT_ORDER = (
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "egress-proxy", "node-agent",
    "registry", "kueue", "lws",
)
START_TIMEOUT = 90.0


@dataclass(frozen=True)
class StackConfig:
    nodes: int = 4
    gpus_per_node: int = 8
    agent_gpus: int = 0
    node_cpu: str = "32"
    node_memory: str = "256Gi"
    # A real node (kubelet, containerd, kube-proxy: realnode/) beside the node agent; the stack's Services then take
    # the real node's range, so it is decided when the stack's data is made (a change needs `down --wipe`).
    real_node: bool = False

    @classmethod
    def from_env(cls) -> StackConfig:
        """Test sessions take the stack's shape from LOOM_STACK_NODES/_GPUS_PER_NODE/_AGENT_GPUS/_REAL_NODE."""
        defaults = cls()
        return cls(
            nodes=int(os.environ.get("LOOM_STACK_NODES", defaults.nodes)),
            gpus_per_node=int(os.environ.get("LOOM_STACK_GPUS_PER_NODE", defaults.gpus_per_node)),
            agent_gpus=int(os.environ.get("LOOM_STACK_AGENT_GPUS", defaults.agent_gpus)),
            real_node=os.environ.get("LOOM_STACK_REAL_NODE", "") not in ("", "0"),
        )

    def shape(self) -> NodeShape:
        return NodeShape(count=self.nodes, gpus=self.gpus_per_node, cpu=self.node_cpu, memory=self.node_memory)


@dataclass
class StackState:
    """What `up` recorded in stack.json: the ports in use and who started the stack."""

    ports: Ports
    config: StackConfig
    started_by: str = "cli"
    bin_dir: str = ""

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    def save(self) -> None:
        STACK_FILE.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls) -> StackState | None:
        try:
            data = json.loads(STACK_FILE.read_text())
            return cls(
                ports=Ports(**data["ports"]),
                config=StackConfig(**data["config"]),
                started_by=data.get("started_by", "cli"),
                bin_dir=data.get("bin_dir", ""),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """`up` and `down` from several shells or test sessions must not interleave."""
    STACK_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports(previous: Ports | None) -> Ports:
    """Keep last time's ports where still free (a shell's KUBECONFIG keeps working); else fresh ones."""
    kept = asdict(previous).values() if previous is not None else ()
    if previous is not None and all(kept) and all(_port_free(p) for p in kept):
        return previous
    sockets = []
    try:
        for _ in Ports.names():
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return Ports(*(s.getsockname()[1] for s in sockets))
    finally:
        for sock in sockets:
            sock.close()


def _with_registry_port(ports: Ports) -> Ports:
    """A stack recorded before the registry (or Kueue) existed has no port for it: a free one, the others kept."""
    missing = [name for name, port in asdict(ports).items() if not port]
    if not missing:
        return ports
    sockets = []
    try:
        for _ in missing:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return replace(ports, **{name: s.getsockname()[1] for name, s in zip(missing, sockets, strict=True)})
    finally:
        for sock in sockets:
            sock.close()


def _write_kubeconfig(path: Path, user: str, server: str, pki: Pki, cert_name: str) -> None:
    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "loom-local", "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(pki.cert(cert_name)),
                    "client-key-data": b64(pki.key(cert_name)),
                },
            }
        ],
        "contexts": [{"name": "loom-local", "context": {"cluster": "loom-local", "user": user}}],
        "current-context": "loom-local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def _wait(what: str, component: str, check: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    """Poll `check` until true; fail fast with the log tail when the component died meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        if procs.running(component) is None:
            raise RuntimeError(
                f"{component} exited while waiting for {what}; its log ends with:\n{procs.exited_with(component)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f}s; see {procs.log_path(component)}")
        time.sleep(0.2)


def _admin_tls(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.cert("admin")), str(pki.key("admin")))
    return context


def _readyz(pki: Pki, server: str) -> bool:
    with httpx.Client(verify=_admin_tls(pki), timeout=5) as http:
        return http.get(f"{server}/readyz").status_code == 200


def _ready_check(component: str, pki: Pki, ports: Ports) -> Callable[[], bool] | None:
    if component == "etcd":
        return lambda: (
            httpx.get(f"http://127.0.0.1:{ports.etcd_client}/health", timeout=5).json().get("health") == "true"
        )
    if component == "kube-apiserver":
        return lambda: _readyz(pki, f"https://127.0.0.1:{ports.apiserver}")
    # Their serving certificates are self-signed in memory: only liveness matters here, not identity.
    if component == "kube-controller-manager":
        return lambda: (
            httpx.get(f"https://127.0.0.1:{ports.controller_manager}/healthz", verify=False).status_code == 200
        )
    if component == "egress-proxy":
        return EGRESS_SOCKET.exists
    if component == "registry":  # the registry API's base endpoint answers 200 once it serves
        return lambda: httpx.get(f"http://127.0.0.1:{ports.registry}/v2/", timeout=5).status_code == 200
    if component == "kube-scheduler":
        return lambda: httpx.get(f"https://127.0.0.1:{ports.scheduler}/healthz", verify=False).status_code == 200
    return None


def _ensure_running(component: Component, progress: Progress) -> bool:
    """Start the component unless it already runs with this exact command line; True if started."""
    current = procs.running(component.name)
    if current is not None and current.argv == component.argv:
        return False
    if current is not None:
        progress(f"{component.name}: configuration changed, restarting")
        procs.stop(component.name)
    procs.start(component.name, component.argv, env=component.env)
    progress(f"{component.name}: started (log {procs.log_path(component.name)})")
    return True


def up(config: StackConfig | None = None, progress: Progress = print, started_by: str = "cli") -> Cluster:
    config = config or StackConfig()
    bin_dir = stack_bin_dir() if is_built() else build(progress)
    node_bin = (node_bin_dir() if node_is_built() else build_node(progress)) if config.real_node else None
    started = time.monotonic()
    with _state_lock():
        previous = StackState.load()
        if previous is not None and previous.config.real_node != config.real_node and ETCD_DATA_DIR.exists():
            raise StackError(
                f"this stack's data was made {'with' if previous.config.real_node else 'without'} the real node (its"
                " Services' address range differs): `loom dev down --wipe` first"
            )
        anything_running = any(procs.running(name) for name in COMPONENT_ORDER)
        if previous is not None and anything_running:
            ports = _with_registry_port(previous.ports)
            # A person's `loom dev up` takes the stack over: test sessions then leave it running.
            started_by = "cli" if started_by == "cli" else previous.started_by
        else:
            ports = _pick_ports(previous.ports if previous else None)
        pki = ensure_pki(PKI_DIR)
        server = f"https://127.0.0.1:{ports.apiserver}"
        _write_kubeconfig(KUBECONFIG, "loom-admin", server, pki, "admin")
        _write_kubeconfig(
            kubeconfig_path("controller-manager"), "system:kube-controller-manager", server, pki, "controller-manager"
        )
        _write_kubeconfig(kubeconfig_path("scheduler"), "system:kube-scheduler", server, pki, "scheduler")
        _write_kubeconfig(
            kubeconfig_path("audited-operator"), "loom-audited-operator", server, pki, "audited-operator"
        )
        if config.real_node:
            _write_kubeconfig(
                realnode.KUBELET_KUBECONFIG, f"system:node:{REAL_NODE_NAME}", server, pki, "realnode-kubelet"
            )
            _write_kubeconfig(realnode.KUBE_PROXY_KUBECONFIG, "system:kube-proxy", server, pki, "kube-proxy")
        AUDIT_POLICY.write_text(yaml.safe_dump(audit_policy()))
        EGRESS_CONFIG.write_text(yaml.safe_dump(egress_selector_config(EGRESS_SOCKET)))
        REGISTRY_DATA_DIR.mkdir(parents=True, exist_ok=True)
        REGISTRY_CONFIG.write_text(yaml.safe_dump(registry_config(ports.registry)))
        state = StackState(ports=ports, config=config, started_by=started_by, bin_dir=str(bin_dir))
        state.save()

        cluster = Cluster(
            kubeconfig=KUBECONFIG,
            server=server,
            bin_dir=bin_dir,
            ca_cert=pki.ca_cert,
            registry=f"127.0.0.1:{ports.registry}",
        )
        etcd, apiserver, *controllers = control_plane(bin_dir, pki, ports, real_node=config.real_node)
        agent = node_agent(pki, ports, config.agent_gpus)
        # etcd, then the API server, then everything that only talks to the API server (and the image registry,
        # which talks to nothing), together.
        for phase in ([etcd], [apiserver], [*controllers, *([agent] if agent else []), registry(bin_dir)]):
            for component in phase:
                _ensure_running(component, progress)
            for component in phase:
                # Components found running are checked too: `up` must only return a usable cluster.
                if check := _ready_check(component.name, pki, ports):
                    _wait(component.name, component.name, check)
            if phase == [apiserver]:
                progress(f"API server ready at {server} ({time.monotonic() - started:.1f}s)")
                # Before kwok starts, so its PortForward informer finds the CRD at once.
                kwok_crds.install_crds(cluster, progress)

        with cluster.api_client() as api:
            names = ensure_nodes(api, config.shape())
            wait_nodes_ready(api, names, timeout=START_TIMEOUT)
            progress(
                f"{len(names)} kwok nodes Ready with {config.gpus_per_node} x nvidia.com/gpu each"
                f" ({time.monotonic() - started:.1f}s)"
            )
            if node_bin is not None:
                realnode.up(api, pki, node_bin, ports.apiserver, f"127.0.0.1:{ports.registry}", progress)
        if node_bin is not None:
            # Pods of the development image run this checkout on the real node (realnode/checkout.py).
            realnode.apply_checkout_policy(cluster, progress)
        keda.install_crds(cluster, progress)  # engine keda's ScaledObjects are checked against KEDA's own schema
        gie.install_crds(cluster, progress)  # a routed vllm service's InferencePool, against GIE's own schema
        _start_kueue(cluster, ports, progress)
        _start_lws(cluster, ports, progress)
        if agent is not None and procs.running(agent.name) is None:
            progress(f"WARNING: the node agent exited; see {procs.log_path(agent.name)}")
    # What examples/ reference (S3, MLflow, the credentials Secret) as pods on the node agent; for a person's
    # `loom dev up` only: test sessions that need them call backing.ensure themselves (it is idempotent).
    if started_by == "cli" and agent is not None:
        from loom.devstack import backing

        backing.ensure(cluster, progress)
    return cluster


def _start_kueue(cluster: Cluster, ports: Ports, progress: Progress) -> None:
    _start_webhook_controller(
        "Kueue", kueue.CONTROLLER, kueue_component, ports.kueue_webhook, ports.kueue_health, cluster, progress
    )


def _start_lws(cluster: Cluster, ports: Ports, progress: Progress) -> None:
    _start_webhook_controller(
        "LWS", lws.CONTROLLER, lws_component, ports.lws_webhook, ports.lws_health, cluster, progress
    )


def _start_webhook_controller(
    label: str, controller: HostWebhookController, component_for: Callable[..., Any], webhook_port: int,
    health_port: int, cluster: Cluster, progress: Progress,
) -> None:
    """A controller run as a host process with a webhook server (Kueue: kueue.py, LeaderWorkerSet: lws.py): its
    objects, its process, then its certificate where its webhook server reads it; ready when its /readyz says so."""
    cluster_ip = controller.install(cluster, progress)
    _add_host_services(controller.host_services(cluster_ip, webhook_port))
    controller.write_config(webhook_port, health_port)
    component = component_for(cluster.bin_dir, KUBECONFIG, controller.config_file)
    _ensure_running(component, progress)
    controller.sync_certificates(cluster)

    def ready() -> bool:
        return httpx.get(f"http://127.0.0.1:{health_port}/readyz", timeout=5).status_code == 200

    _wait(f"{label} (certificates, webhooks)", component.name, ready, timeout=START_TIMEOUT)
    progress(f"{label.lower()}: ready")


def _add_host_services(entries: dict[str, Any]) -> None:
    """Merge a host process's Service entries into host-services.json (the egress proxy rereads it per CONNECT)."""
    try:
        current = dict(json.loads(HOST_SERVICES.read_text()))
    except (OSError, ValueError):
        current = {}
    staging = HOST_SERVICES.with_suffix(".tmp")
    staging.write_text(json.dumps({**current, **entries}, indent=2))
    staging.rename(HOST_SERVICES)


def join_session() -> None:
    """Record that this process (a test session) uses the stack; see leave_session."""
    USERS_DIR.mkdir(parents=True, exist_ok=True)
    (USERS_DIR / str(os.getpid())).touch()


def leave_session() -> bool:
    """Drop this process's claim; True when the stack may be stopped on its behalf.

    That is: no other live process still uses it, and a test session (not a person) started it.
    Several test sessions may share one stack; the last one out stops it.
    """
    with _state_lock():
        (USERS_DIR / str(os.getpid())).unlink(missing_ok=True)
        others = []
        for lease in USERS_DIR.glob("*"):
            if lease.name.isdigit() and Path(f"/proc/{lease.name}").exists():
                others.append(lease.name)
            else:
                lease.unlink(missing_ok=True)
        state = StackState.load()
        return not others and state is not None and state.started_by != "cli"


def _strays() -> list[int]:
    """Processes of ours that lost their record (e.g. .state/stack/run was deleted while running)."""
    found = []
    marker = str(STACK_DIR)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and Path(argv[0].decode(errors="replace")).name
            in (
                "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "registry", "kueue",
                "lws",
            )
            and any(marker in a.decode(errors="replace") for a in argv)
        ):
            found.append(int(entry.name))
    return found


def down(progress: Progress = print, wipe: bool = False) -> None:
    with _state_lock():
        # First, while the API server still runs: the real node's programs, then everything it did to the host.
        realnode.down(progress)
        for name in reversed(COMPONENT_ORDER):
            if procs.stop(name):
                progress(f"{name}: stopped")
        for pid in _strays():
            progress(f"stray process {pid}: killed")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        for group in procs.pod_groups_left(AGENT_STATE_DIR):
            progress(f"a pod's processes (group {group}) outlived the node agent: killed")
            procs.kill_group(group)
        if wipe:
            # Keep the lock file itself: another waiter may hold it open.
            for child in STACK_DIR.iterdir():
                if child != LOCK_FILE:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            shutil.rmtree(realnode.NODE_DIR, ignore_errors=True)  # the real node's containerd and kubelet data
            progress(f"wiped {STACK_DIR}")


def status() -> dict[str, Any]:
    state = StackState.load()
    components = {}
    for name in (*COMPONENT_ORDER, *realnode.COMPONENTS):
        record = procs.running(name)
        components[name] = {
            "running": record is not None,
            "pid": record.pid if record else None,
            "log": str(procs.log_path(name)),
        }
    result: dict[str, Any] = {"components": components, "kubeconfig": str(KUBECONFIG)}
    if state is not None:
        result |= {
            "server": state.server,
            "started_by": state.started_by,
            "bin_dir": state.bin_dir,
            "config": asdict(state.config),
        }
    return result


def current() -> Cluster | None:
    """The running stack, if its API server answers; None otherwise."""
    state = StackState.load()
    if state is None or procs.running("kube-apiserver") is None:
        return None
    pki = Pki(PKI_DIR)
    try:
        if not _readyz(pki, state.server):
            return None
    except (httpx.HTTPError, OSError):
        return None
    registry = f"127.0.0.1:{state.ports.registry}" if state.ports.registry else ""
    return Cluster(
        kubeconfig=KUBECONFIG, server=state.server, bin_dir=Path(state.bin_dir), ca_cert=pki.ca_cert, registry=registry
    )


__all__ = ["AGENT_NODE_NAME", "Cluster", "StackConfig", "current", "down", "status", "up"]
