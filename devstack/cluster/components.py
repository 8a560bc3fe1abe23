"""The command line of every component of the local control plane, in start order."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.devstack.cluster.kwok_crds import ENABLED_KINDS
from loom.devstack.cluster.paths import (
    AGENT_IMAGE_ENVIRONMENTS,
    AGENT_MAIN,
    AGENT_STATE_DIR,
    AUDIT_LOG,
    AUDIT_POLICY,
    ETCD_DATA_DIR,
    KWOK_STAGES_FILE,
    REGISTRY_CONFIG,
    REGISTRY_DATA_DIR,
    STACK_DIR,
)
from loom.devstack.cluster.pki import AGENT_NODE_NAME, REAL_NODE_IP, SERVICE_CIDR, Pki
from loom.devstack.cluster.realnode import config as realnode_config

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_POD_CIDR = "10.244.0.0/16"
# A stack with a real node: its Services' range (never routed anywhere; realnode/config.py).
REAL_NODE_SERVICE_CIDR = realnode_config.SERVICE_CIDR
# kwok manages only the nodes carrying this label (its own convention), never our node agent's.
KWOK_NODE_SELECTOR = "type=kwok"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    kubelet: int
    # The image registry (0 in a stack.json written before it existed: `up` then picks a port).
    registry: int = 0
    # Kueue's webhook server and health probes (likewise 0 in an older stack.json).
    kueue_webhook: int = 0
    kueue_health: int = 0
    # LeaderWorkerSet's webhook server and health probes (lws.py; likewise 0 in an older stack.json).
    lws_webhook: int = 0
    lws_health: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)


@dataclass(frozen=True)
class Component:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None


# The API server's `cluster` traffic (webhooks via Services, kubelets) goes through the egress proxy (egress.py).
EGRESS_SOCKET = STACK_DIR / "egress.sock"
EGRESS_CONFIG = STACK_DIR / "egress-selector.yaml"
# Services served by a host process of the stack rather than a pod (Kueue's and LWS's webhooks), for the egress proxy.
HOST_SERVICES = STACK_DIR / "host-services.json"


def egress_selector_config(socket_path: Path) -> dict[str, Any]:
    """The API server's EgressSelectorConfiguration: `cluster` traffic through this proxy, the rest direct."""
    return {
        "apiVersion": "apiserver.k8s.io/v1beta1",
        "kind": "EgressSelectorConfiguration",
        "egressSelections": [
            {
                "name": "cluster",
                "connection": {"proxyProtocol": "HTTPConnect", "transport": {"uds": {"udsName": str(socket_path)}}},
            }
        ],
    }


AUDITED_USER = "loom-audited-operator"


def audit_policy() -> dict[str, Any]:
    """Metadata (verb, resource, name, user, response code) for the audited operator identity's requests, nothing
    for anyone else: the log costs the shared stack nothing unless an operator runs as that identity."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived", "ResponseStarted"],
        "rules": [{"level": "Metadata", "users": [AUDITED_USER]}, {"level": "None"}],
    }


def kubeconfig_path(user: str) -> Path:
    return STACK_DIR / f"{user}.kubeconfig"


def _delegated_auth(kubeconfig: Path) -> list[str]:
    # The controller manager and scheduler authenticate their own /metrics callers through the
    # API server; /healthz and friends stay open to anyone (their default).
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
    ]


def _real_node_apiserver_flags(args: list[str]) -> list[str]:
    """The API server of a stack with a real node (realnode/): Services in the real node's own range (kube-proxy
    programs only it, never the node agent's 10.96.0.0/16 of other stacks on this machine), the `kubernetes`
    Service's endpoint at the node's address (the relay there forwards to loopback), kubelets dialled at their
    InternalIP (the real kubelet's Hostname does not resolve)."""
    replaced = {
        f"--service-cluster-ip-range={SERVICE_CIDR}": f"--service-cluster-ip-range={REAL_NODE_SERVICE_CIDR}",
        "--advertise-address=127.0.0.1": f"--advertise-address={REAL_NODE_IP}",
        "--endpoint-reconciler-type=none": "--endpoint-reconciler-type=lease",
    }
    return [replaced.get(arg, arg) for arg in args] + ["--kubelet-preferred-address-types=InternalIP,Hostname"]


def control_plane(bin_dir: Path, pki: Pki, ports: Ports, real_node: bool = False) -> list[Component]:
    etcd_url = f"http://127.0.0.1:{ports.etcd_client}"
    peer_url = f"http://127.0.0.1:{ports.etcd_peer}"
    etcd = Component(
        "etcd",
        [
            str(bin_dir / "etcd"),
            "--name=loom",
            f"--data-dir={ETCD_DATA_DIR}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=loom={peer_url}",
            # A throwaway dev cluster: durability across power loss is not worth an fsync per write
            # on a shared 2-core machine.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
    )
    apiserver = Component(
        "kube-apiserver",
        [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports.apiserver}",
            f"--cert-dir={pki.directory / 'apiserver-generated'}",
            f"--tls-cert-file={pki.cert('apiserver')}",
            f"--tls-private-key-file={pki.key('apiserver')}",
            f"--client-ca-file={pki.ca_cert}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # `kubectl logs/exec` are proxied to the node agent with this client identity.
            f"--kubelet-client-certificate={pki.cert('apiserver-kubelet-client')}",
            f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
            "--allow-privileged=true",
            "--enable-admission-plugins=NodeRestriction",
            # Aggregated API servers (a metrics adapter, say) trust requests the API server proxies
            # to them with this identity.
            f"--proxy-client-cert-file={pki.cert('front-proxy-client')}",
            f"--proxy-client-key-file={pki.key('front-proxy-client')}",
            f"--requestheader-client-ca-file={pki.ca_cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--profiling=false",
            "--v=1",
            # The API server advertises a loopback address, which the `kubernetes` Service's
            # endpoints may not hold; nothing routes service IPs here anyway (no kube-proxy).
            "--endpoint-reconciler-type=none",
            # Webhooks behind a Service: their ClusterIP is reached through the egress proxy (egress.py).
            f"--egress-selector-config-file={EGRESS_CONFIG}",
            # Requests of the audited operator identity only (audit_policy): counted by bench_steady_requests.py.
            f"--audit-policy-file={AUDIT_POLICY}",
            f"--audit-log-path={AUDIT_LOG}",
            "--audit-log-format=json",
            "--audit-log-maxsize=100",
            "--audit-log-maxbackup=1",
        ],
    )
    if real_node:
        apiserver = Component(apiserver.name, _real_node_apiserver_flags(apiserver.argv))
    controller_manager = Component(
        "kube-controller-manager",
        [
            str(bin_dir / "kube-controller-manager"),
            *_delegated_auth(kubeconfig_path("controller-manager")),
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.controller_manager}",
            "--controllers=*",
            # Each controller acts as its own service account, so RBAC is exercised as in production.
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.ca_key}",
            f"--service-cluster-ip-range={REAL_NODE_SERVICE_CIDR if real_node else SERVICE_CIDR}",
            # A single instance: waiting for a leader lease only slows the start down.
            "--leader-elect=false",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "--v=1",
        ],
    )
    scheduler = Component(
        "kube-scheduler",
        [
            str(bin_dir / "kube-scheduler"),
            *_delegated_auth(kubeconfig_path("scheduler")),
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.scheduler}",
            "--leader-elect=false",
            "--v=1",
        ],
    )
    kwok = Component(
        "kwok",
        [
            str(bin_dir / "kwok"),
            f"--kubeconfig={kubeconfig_path('admin')}",
            f"--config={KWOK_STAGES_FILE}",
            f"--manage-nodes-with-label-selector={KWOK_NODE_SELECTOR}",
            f"--cidr={KWOK_POD_CIDR}",
            "--node-ip=127.0.0.1",
            f"--node-port={ports.kwok}",
            f"--server-address=127.0.0.1:{ports.kwok}",
            f"--tls-cert-file={pki.cert('kwok')}",
            f"--tls-private-key-file={pki.key('kwok')}",
            "--node-lease-duration-seconds=40",
            # Port-forwards to its pods go where a PortForward object names (loom.devstack.cluster.kwok_crds).
            f"--enable-crds={','.join(ENABLED_KINDS)}",
        ],
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    egress = Component(
        "egress-proxy",
        [
            sys.executable,
            "-m",
            "loom.devstack.cluster.egress",
            f"--socket={EGRESS_SOCKET}",
            f"--services={HOST_SERVICES}",
            f"--services={AGENT_STATE_DIR / 'services.json'}",
        ],
        env,
    )
    return [etcd, apiserver, controller_manager, scheduler, kwok, egress]


def registry_config(port: int, data_dir: Path = REGISTRY_DATA_DIR) -> dict[str, Any]:
    """The distribution registry's configuration: loopback only, plain HTTP (nothing leaves the machine), blobs on
    disk under the stack's state, deletes allowed (a test may clean up), quiet logs."""
    return {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(data_dir)},
            "delete": {"enabled": True},
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": {"addr": f"127.0.0.1:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }


def registry(bin_dir: Path, config_file: Path = REGISTRY_CONFIG) -> Component:
    """The CNCF distribution registry (go/registry): what `make images push` pushes to on the local stack, and where
    a test pulls manifests from by digest. Its configuration (port included) is in `config_file`."""
    # Its OpenTelemetry exporter would otherwise try an OTLP collector on localhost for every request.
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
    return Component("registry", [str(bin_dir / "registry"), "serve", str(config_file)], env)


def agent_cpu() -> int:
    """The CPUs the node agent advertises: four per core, at least 8. Its pods are host processes sharing the
    machine's cores, so their CPU requests are bookkeeping here; advertising the bare core count (2 on the dev
    machine) left the examples' services Unschedulable for "Insufficient cpu" once the examples' model servers, the
    vLLM service and the examples' backing services ran side by side, as `make test` runs them."""
    return max(8, 4 * (os.cpu_count() or 1))


def node_agent(pki: Pki, ports: Ports, gpus: int) -> Component | None:
    """Our node agent, which really runs pods as local processes; started only where it exists."""
    if not AGENT_MAIN.exists():
        return None
    env = dict(os.environ)
    # The repository has a top-level folder named `operator`: never let the cwd shadow the stdlib.
    env["PYTHONSAFEPATH"] = "1"
    return Component(
        "node-agent",
        [
            sys.executable,
            "-m",
            "loom.devstack.agent",
            "--kubeconfig",
            str(kubeconfig_path("admin")),
            "--node-name",
            AGENT_NODE_NAME,
            "--state-dir",
            str(AGENT_STATE_DIR),
            "--kubelet-port",
            str(ports.kubelet),
            "--tls-cert",
            str(pki.cert("kubelet")),
            "--tls-key",
            str(pki.key("kubelet")),
            "--gpus",
            str(gpus),
            "--cpu",
            str(agent_cpu()),
            *(f"--image-env={name}={bin_dir}" for name, bin_dir in AGENT_IMAGE_ENVIRONMENTS.items()),
        ],
        env,
    )


def kueue(bin_dir: Path, kubeconfig: Path, config_file: Path) -> Component:
    """Kueue's controller manager (go/kueue) on the host, as admin; its configuration and objects: kueue.py."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return Component("kueue", [str(bin_dir / "kueue"), f"--config={config_file}", "--zap-log-level=info"], env)


def lws(bin_dir: Path, kubeconfig: Path, config_file: Path) -> Component:
    """LeaderWorkerSet's controller manager (go/lws) on the host, as admin; its configuration and objects: lws.py."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    argv = [str(bin_dir / "lws"), f"--config={config_file}", "--zap-devel=false", "--zap-log-level=info"]
    return Component("lws", argv, env)
