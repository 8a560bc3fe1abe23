"""The real node (devstack/cluster/realnode, issue 29): the kubelet and containerd 2.x run pods from images, each pod in
its own network namespace on the stack's bridge, Services through kube-proxy.

Needs a stack started with the real node (`LOOM_STACK_REAL_NODE=1`, `make test-real-node`, or `loom dev up
--real-node`); `make test` runs it as its own tier beside the e2e tier (marker `real_node`), see
devstack/cluster/README.md for its costs.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import uuid
from typing import Any

import httpx
import pytest
from kubernetes import client

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import REPO_ROOT
from loom.devstack.cluster.realnode import config
from loom.devstack.cluster.realnode.images import DEV_IMAGE, checkout_environment

pytestmark = [pytest.mark.core, pytest.mark.real_node, pytest.mark.slow]
PORT = 8080
# Serves its own pod name on PORT: which pod answered is then visible to every client.
SERVE_OWN_NAME = (
    "import http.server, os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = os.environ['POD_NAME'].encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "print('serving', os.environ['POD_NAME'], flush=True)\n"
    f"http.server.ThreadingHTTPServer(('', {PORT}), H).serve_forever()\n"
)
# What a pod does to reach the API server the way in-cluster clients do: the `kubernetes` Service's address from its
# environment, its service account's token and CA.
CALL_API_SERVER = (
    "import json, os, socket, ssl, time, urllib.request\n"
    "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
    "host, port = os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT']\n"
    "req = urllib.request.Request(f'https://{host}:{port}/version',\n"
    "    headers={'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
    "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
    # Retried for a minute as in-cluster clients do: on a machine this busy one attempt can miss a timeout.
    "deadline = time.monotonic() + 60\n"
    "while True:\n"
    "    try:\n"
    "        address = socket.gethostbyname('kubernetes.default')\n"
    "        version = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))['gitVersion']\n"
    "        break\n"
    "    except OSError:\n"
    "        if time.monotonic() > deadline:\n"
    "            raise\n"
    "        time.sleep(1)\n"
    "print('dns', address)\n"
    "print('service', host, 'version', version)\n"
)


@pytest.fixture(scope="module")
def real_node(cluster: Cluster, kube_api: client.ApiClient) -> client.V1Node:
    nodes = client.CoreV1Api(kube_api).list_node(field_selector=f"metadata.name={config.NODE_NAME}").items
    if not nodes:
        pytest.fail(
            "this stack runs without the real node: start it with LOOM_STACK_REAL_NODE=1 (`make test-real-node`) or"
            " `loom dev up --real-node` (after `loom dev down --wipe` if its data was made without it)"
        )
    node: client.V1Node = nodes[0]
    return node


def pod_manifest(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": DEV_IMAGE,
        "imagePullPolicy": "Never",  # imported into containerd, never pulled (there is no registry to pull from)
        "command": command,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        **extra.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": extra.pop("app", name)}},
        "spec": {
            "nodeSelector": config.NODE_SELECTOR,
            "tolerations": [config.TOLERATION],
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            **extra,
        },
    }


def run_pod(api: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> client.V1Pod:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, manifest)
    name = manifest["metadata"]["name"]

    def running() -> client.V1Pod | None:
        pod: client.V1Pod = core.read_namespaced_pod(name, namespace)
        once = manifest["spec"].get("restartPolicy") == "Never"
        if pod.status.phase == "Failed" or (pod.status.phase == "Succeeded" and not once):
            log = core.read_namespaced_pod_log(name, namespace)
            raise AssertionError(f"pod {name} ended: {pod.status}\nits log:\n{log}")
        ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
        done = once and pod.status.phase == "Succeeded"
        return pod if ready or done else None

    return wait_until(running, timeout=90, what=f"pod {name} on the real node")


def finished_log(cluster: Cluster, namespace: str, pod: str) -> str:
    """A finished container's log, once it has any: right after the container exits the kubelet can still serve an
    empty log (seen once in make test: empty at once, both lines a second later), and every pod read this way prints
    something."""
    return wait_until(
        lambda: cluster.kubectl("logs", "-n", namespace, pod).stdout,
        timeout=30,
        what=f"the log of the finished pod {pod}",
        interval=0.5,
    )


def test_the_node_is_ready_with_containerd_2(real_node: client.V1Node, cluster: Cluster) -> None:
    shown = json.loads(cluster.kubectl("get", "node", config.NODE_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in shown["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    info = shown["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://2.")
    assert info["kubeletVersion"] == "v1.37.2"
    assert {"type": "InternalIP", "address": config.NODE_IP} in shown["status"]["addresses"]
    assert config.TAINT in shown["spec"]["taints"]


def test_a_pod_has_its_own_address_and_reaches_the_api_server_through_the_kubernetes_service(
    real_node: client.V1Node, kube_api: client.ApiClient, cluster: Cluster, namespace: str
) -> None:
    manifest = pod_manifest("api-caller", ["python3", "-c", CALL_API_SERVER], restartPolicy="Never")
    pod = run_pod(kube_api, namespace, manifest)
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(config.POD_CIDR)
    assert pod.status.host_ip == config.NODE_IP
    log = finished_log(cluster, namespace, "api-caller").splitlines()
    # Cluster DNS (CoreDNS on the node) resolves the Service's name to its ClusterIP.
    assert log == [f"dns {config.KUBERNETES_SERVICE_IP}", f"service {config.KUBERNETES_SERVICE_IP} version v1.37.2"]


def test_logs_exec_and_port_forward(
    real_node: client.V1Node, kube_api: client.ApiClient, cluster: Cluster, namespace: str
) -> None:
    name = f"web-{uuid.uuid4().hex[:6]}"
    run_pod(
        kube_api,
        namespace,
        pod_manifest(
            name,
            ["python3", "-u", "-c", SERVE_OWN_NAME],
            container={"readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1}},
        ),
    )
    assert cluster.kubectl("logs", "-n", namespace, name).stdout.strip() == f"serving {name}"
    # exec: a command inside the container's own namespaces (its hostname is the pod's name).
    assert cluster.kubectl("exec", "-n", namespace, name, "--", "cat", "/proc/sys/kernel/hostname").stdout.strip() == (
        name
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local_port = probe.getsockname()[1]
    forward = subprocess.Popen(
        [str(cluster.bin_dir / "kubectl"), "port-forward", "-n", namespace, f"pod/{name}", f"{local_port}:{PORT}"],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def answered() -> str | None:
            try:
                return httpx.get(f"http://127.0.0.1:{local_port}/", timeout=5).text
            except httpx.HTTPError:
                return None

        assert wait_until(answered, timeout=30, what="a response through kubectl port-forward") == name
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def test_two_pods_listen_on_the_same_port_and_a_service_balances_over_them(
    real_node: client.V1Node, kube_api: client.ApiClient, cluster: Cluster, namespace: str
) -> None:
    probe = {"readinessProbe": {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1}}
    pods = [
        run_pod(
            kube_api,
            namespace,
            pod_manifest(f"same-port-{i}", ["python3", "-u", "-c", SERVE_OWN_NAME], app="same-port", container=probe),
        )
        for i in range(2)
    ]
    addresses = {pod.metadata.name: pod.status.pod_ip for pod in pods}
    assert len(set(addresses.values())) == 2
    # Each pod answers on its own address (the host routes to the bridge): no clash on the port.
    for name, address in addresses.items():
        assert httpx.get(f"http://{address}:{PORT}/", timeout=10).text == name
    core = client.CoreV1Api(kube_api)
    service = core.create_namespaced_service(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "same-port"},
            "spec": {"selector": {"app": "same-port"}, "ports": [{"port": 80, "targetPort": PORT}]},
        },
    )
    cluster_ip = service.spec.cluster_ip
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(config.SERVICE_CIDR)
    # From a pod, by the Service's name (cluster DNS), through kube-proxy's rules: both backends answer in time.
    fetch = (
        "import urllib.request, sys\n"
        "seen = set()\n"
        "for _ in range(60):\n"
        f"    try: seen.add(urllib.request.urlopen('http://same-port.{namespace}.svc/', timeout=3).read().decode())\n"
        "    except OSError: pass\n"
        "print(' '.join(sorted(seen)))\n"
    )

    def both_seen() -> str | None:
        out = cluster.kubectl("exec", "-n", namespace, "same-port-0", "--", "python3", "-c", fetch).stdout.strip()
        return out if out == "same-port-0 same-port-1" else None

    assert wait_until(both_seen, timeout=60, what=f"both pods answering through {cluster_ip}", interval=1)


def test_a_pod_runs_loom_from_the_checkout_mounted_read_only(
    real_node: client.V1Node, kube_api: client.ApiClient, cluster: Cluster, namespace: str
) -> None:
    folders = checkout_environment(REPO_ROOT)
    volumes = [
        {"name": f"env-{i}", "hostPath": {"path": str(folder), "type": "Directory"}} for i, folder in enumerate(folders)
    ]
    mounts = [{"name": f"env-{i}", "mountPath": str(folder), "readOnly": True} for i, folder in enumerate(folders)]
    check = "import loom.operator, pathlib; print(pathlib.Path(loom.operator.__file__).parent)"
    manifest = pod_manifest(
        "loom-env",
        [str(REPO_ROOT / ".venv" / "bin" / "python"), "-c", check],
        restartPolicy="Never",
        container={"volumeMounts": mounts, "env": [{"name": "PYTHONSAFEPATH", "value": "1"}]},
        volumes=volumes,
    )
    run_pod(kube_api, namespace, manifest)
    assert finished_log(cluster, namespace, "loom-env").strip() == str(REPO_ROOT / "operator")
    # Read-only: the pod cannot change the checkout (which is writable on the host: the mount refuses the write).
    target = REPO_ROOT / f".realnode-write-test-{uuid.uuid4().hex[:6]}"
    writer = pod_manifest(
        "loom-env-write",
        ["python3", "-c", f"open('{target}', 'w')"],
        restartPolicy="Never",
        container={"volumeMounts": mounts},
        volumes=volumes,
    )
    client.CoreV1Api(kube_api).create_namespaced_pod(namespace, writer)

    def failed() -> bool:
        pod = client.CoreV1Api(kube_api).read_namespaced_pod("loom-env-write", namespace)
        return bool(pod.status.phase == "Failed")

    wait_until(failed, timeout=60, what="the pod writing into the read-only checkout to fail")
    assert "Read-only file system" in finished_log(cluster, namespace, "loom-env-write")
    assert not target.exists()
