"""Start and stop the real node: containerd (with runc and the CNI plugins), the kubelet, kube-proxy, and the relay
that puts the API server on the node's address. The host side (bridge, sysctls, cleanup) is host.py; what each
program is configured with is config.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client

from loom.devstack.cluster import procs
from loom.devstack.cluster.components import Component
from loom.devstack.cluster.paths import KUBECONFIG, REPO_ROOT, STACK_DIR, STATE_DIR
from loom.devstack.cluster.pki import Pki
from loom.devstack.cluster.realnode import checkout, config, host, images

Progress = Callable[[str], None]
NODE_DIR = STATE_DIR / "realnode"
CONTAINERD_ROOT = NODE_DIR / "containerd"
KUBELET_ROOT = NODE_DIR / "kubelet"
POD_LOGS = NODE_DIR / "pod-logs"
CNI_CONF_DIR = NODE_DIR / "cni" / "net.d"
CNI_DATA_DIR = NODE_DIR / "cni" / "networks"
IMAGES_DIR = NODE_DIR / "images"
# containerd's registry hosts (hosts.toml per registry): the stack's own registry, from which the node pulls.
REGISTRY_HOSTS_DIR = NODE_DIR / "registry-hosts"
CONTAINERD_CONFIG = NODE_DIR / "containerd.toml"
KUBELET_CONFIG = NODE_DIR / "kubelet.yaml"
KUBE_PROXY_CONFIG = NODE_DIR / "kube-proxy.yaml"
COREFILE = NODE_DIR / "Corefile"
# Sockets and containerd's state (its pods' network namespaces among it) on tmpfs, with short paths.
CONTAINERD_SOCKET = host.RUN_DIR / "containerd.sock"
CONTAINERD_STATE = host.RUN_DIR / "containerd"
KUBELET_KUBECONFIG = STACK_DIR / "realnode-kubelet.kubeconfig"
KUBE_PROXY_KUBECONFIG = STACK_DIR / "kube-proxy.kubeconfig"
# Start order; `down` stops them in reverse.
COMPONENTS = ("apiserver-relay", "containerd", "kubelet", "kube-proxy", "coredns")
START_TIMEOUT = 90.0


def runc_binary() -> str:
    runc = shutil.which("runc") or shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin")
    if runc is None:
        raise host.RealNodeError("the real node needs runc (apt-get install runc)")
    return runc


def components(node_bin: Path, apiserver_port: int) -> list[Component]:
    path = f"{node_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {**os.environ, "PATH": path}
    relay = Component(
        "apiserver-relay",
        [
            sys.executable,
            "-m",
            "loom.devstack.cluster.realnode.relay",
            f"--listen={config.NODE_IP}:{apiserver_port}",
            f"--target=127.0.0.1:{apiserver_port}",
        ],
        {**os.environ, "PYTHONSAFEPATH": "1"},
    )
    containerd = Component("containerd", [str(node_bin / "containerd"), f"--config={CONTAINERD_CONFIG}"], env)
    kubelet = Component(
        "kubelet",
        [
            str(node_bin / "kubelet"),
            f"--config={KUBELET_CONFIG}",
            f"--kubeconfig={KUBELET_KUBECONFIG}",
            f"--root-dir={KUBELET_ROOT}",
            f"--hostname-override={config.NODE_NAME}",
            f"--node-ip={config.NODE_IP}",
            f"--node-labels={config.TAINT_KEY}=true",
            "--v=1",
        ],
        env,
    )
    proxy = Component("kube-proxy", [str(node_bin / "kube-proxy"), f"--config={KUBE_PROXY_CONFIG}", "--v=1"], env)
    dns = Component("coredns", [str(node_bin / "coredns"), "-conf", str(COREFILE)], env)
    return [relay, containerd, kubelet, proxy, dns]


def write_configs(pki: Pki, node_bin: Path, registry: str) -> None:
    """Every configuration file of the node's programs; `registry`: the stack's registry (host:port)."""
    for folder in (CONTAINERD_ROOT, KUBELET_ROOT, POD_LOGS, CNI_CONF_DIR, CNI_DATA_DIR, IMAGES_DIR, CONTAINERD_STATE):
        folder.mkdir(parents=True, exist_ok=True)
    CONTAINERD_CONFIG.write_text(
        config.containerd_config(
            CONTAINERD_ROOT,
            CONTAINERD_STATE,
            CONTAINERD_SOCKET,
            node_bin,
            CNI_CONF_DIR,
            runc_binary(),
            REGISTRY_HOSTS_DIR,
        )
    )
    shutil.rmtree(REGISTRY_HOSTS_DIR, ignore_errors=True)  # a registry of an earlier start (another port) goes
    (REGISTRY_HOSTS_DIR / registry).mkdir(parents=True)
    (REGISTRY_HOSTS_DIR / registry / "hosts.toml").write_text(config.registry_hosts_toml(registry))
    (CNI_CONF_DIR / f"10-{config.CNI_NETWORK}.conflist").write_text(
        json.dumps(config.cni_conflist(CNI_DATA_DIR), indent=2)
    )
    KUBELET_CONFIG.write_text(
        yaml.safe_dump(
            config.kubelet_config(
                pki.ca_cert, pki.cert("realnode-kubelet"), pki.key("realnode-kubelet"), CONTAINERD_SOCKET, POD_LOGS
            )
        )
    )
    KUBE_PROXY_CONFIG.write_text(yaml.safe_dump(config.kube_proxy_config(KUBE_PROXY_KUBECONFIG)))
    # CoreDNS reads Services and pods as the stack's admin (a dev stack; a real cluster gives it a read-only role).
    COREFILE.write_text(config.corefile(KUBECONFIG))


def _wait(what: str, component: str, check: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError, client.ApiException):
            pass
        if procs.running(component) is None:
            raise RuntimeError(
                f"{component} exited while waiting for {what}; its log ends with:\n{procs.exited_with(component)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f}s; see {procs.log_path(component)}")
        time.sleep(0.2)


def _proxy_synced() -> bool:
    """Whether kube-proxy has written the Service rules once: its /livez lists a per-family status only after a
    proxier's first successful sync."""
    livez = f"http://{config.NODE_IP}:{config.KUBE_PROXY_HEALTHZ_PORT}/livez"
    return bool(httpx.get(livez, timeout=5).json().get("status"))


def _containerd_answers(ctr: Path) -> bool:
    result = subprocess.run(
        [str(ctr), "--address", str(CONTAINERD_SOCKET), "version"], capture_output=True, text=True, check=False
    )
    return result.returncode == 0 and "Server:" in result.stdout


def node_ready(api: client.ApiClient) -> bool:
    node = client.CoreV1Api(api).read_node(config.NODE_NAME)
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def up(api: client.ApiClient, pki: Pki, node_bin: Path, apiserver_port: int, registry: str, progress: Progress) -> None:
    """Bring the real node up (idempotent: what runs with the same command line is left alone) and wait for it to
    be Ready. `registry`: the stack's image registry (host:port), which the node pulls from."""
    started = time.monotonic()
    host.claim(STATE_DIR)
    host.setup_network(progress)
    host.prepare_cgroups()
    write_configs(pki, node_bin, registry)
    relay, containerd, kubelet, proxy, dns = components(node_bin, apiserver_port)
    for component in (relay, containerd):
        _ensure_running(component, progress)
    _wait("containerd", "containerd", lambda: _containerd_answers(node_bin / "ctr"))
    ctr = node_bin / "ctr"
    if not images.image_present(ctr, CONTAINERD_SOCKET, config.SANDBOX_IMAGE):
        images.import_archive(ctr, CONTAINERD_SOCKET, images.sandbox_archive(node_bin / "pause", IMAGES_DIR))
    if not images.image_present(ctr, CONTAINERD_SOCKET, images.DEV_IMAGE):
        images.import_archive(ctr, CONTAINERD_SOCKET, images.dev_archive(progress))
    for component in (kubelet, proxy, dns):
        _ensure_running(component, progress)
    _wait(f"node {config.NODE_NAME} Ready", "kubelet", lambda: node_ready(api))
    ready = f"http://{config.NODE_IP}:{config.DNS_READY_PORT}/ready"
    _wait("cluster DNS", "coredns", lambda: httpx.get(ready, timeout=5).status_code == 200)
    # kube-proxy answers healthy while it starts; Service addresses work once its first sync wrote the rules.
    _wait("kube-proxy's first sync of the Service rules", "kube-proxy", _proxy_synced)
    progress(f"real node {config.NODE_NAME} Ready ({time.monotonic() - started:.1f}s)")


def apply_checkout_policy(cluster: Any, progress: Progress) -> None:
    """The MutatingAdmissionPolicy that gives development-image pods the checkout (checkout.py), applied as the
    stack's admin (server-side: `up` again changes nothing)."""
    manifests = checkout.checkout_policy(
        images.DEV_IMAGE, images.checkout_environment(REPO_ROOT), REPO_ROOT / ".venv" / "bin"
    )
    stdin = "".join(f"---\n{json.dumps(m)}\n" for m in manifests)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loom-dev", "-f", "-", stdin=stdin)
    progress(f"real node: pods of {images.DEV_IMAGE} get this checkout ({checkout.POLICY})")


def _ensure_running(component: Component, progress: Progress) -> None:
    current = procs.running(component.name)
    if current is not None and current.argv == component.argv:
        return
    if current is not None:
        procs.stop(component.name)
    procs.start(component.name, component.argv, env=component.env)
    progress(f"{component.name}: started (log {procs.log_path(component.name)})")


def down(progress: Progress) -> None:
    """Stop the real node's programs and restore the host, when this stack owns the machine's real node (or left
    any of its programs running)."""
    ours = host.owner() == str(STATE_DIR)
    if not ours and not any(procs.running(name) for name in COMPONENTS):
        return
    for name in ("coredns", "kube-proxy", "kubelet"):
        if procs.stop(name):
            progress(f"{name}: stopped")
    shims = host.shim_pids(CONTAINERD_SOCKET)
    if procs.stop("containerd"):
        progress("containerd: stopped")
    host.kill_processes(shims)
    if procs.stop("apiserver-relay"):
        progress("apiserver-relay: stopped")
    if ours:
        host.release([NODE_DIR, host.RUN_DIR], POD_LOGS, progress)
        # Every pod is gone: their address leases are too (containerd's own records are reconciled at its start).
        shutil.rmtree(CNI_DATA_DIR, ignore_errors=True)
