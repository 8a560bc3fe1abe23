"""The SDK's default way to a Service from outside the cluster, `loom.client.PortForward`, end to end.

A pod on one of the stack's kwok nodes sits behind a Service; kwok pretends to run it, and a kwok PortForward
object (loom.devstack.cluster.kwok_crds) tells kwok's kubelet server to carry forwards to the pod's port to an HTTP
server this test runs on the host (an ephemeral port, so parallel sessions never collide). A `Client` built from
the stack's kubeconfig, with its default access (PortForward outside a cluster), opens the Service's in-cluster URL:
the stream goes through the real API server (pods/portforward) and kwok's kubelet server, and the request gets the
host server's answer. Without the PortForward object kwok accepts the stream and then closes it (it has nowhere to
send it), so the request fails and the host server sees nothing: the answer can only come through the forward.
(The SDK's PortForwardRefused covers nodes that refuse the stream outright, like the node agent; kwok's refusal
comes later, on the forward's error channel, so here it reaches the caller as a closed connection.)
"""

from __future__ import annotations

import http.server
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
from kubernetes import client

from loom.client import Client, PortForward
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import kwok_placement

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]

POD_PORT = 8080


class Answers(http.server.BaseHTTPRequestHandler):
    token = ""
    paths: list[str] = []

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        body = f"{self.token} {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def host_server() -> Iterator[tuple[int, type[Answers]]]:
    """An HTTP server on this machine, on a port the kernel picks."""
    handler = type("HostAnswers", (Answers,), {"token": uuid.uuid4().hex, "paths": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def kwok_pod_behind_a_service(kube_api: client.ApiClient, namespace: str) -> str:
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "echo-0", "labels": {"app": "echo"}},
            "spec": {
                **kwok_placement(),
                "containers": [
                    {
                        "name": "echo",
                        "image": "loom/e2e-echo:v1",
                        "ports": [{"name": "http", "containerPort": POD_PORT}],
                    }
                ],
            },
        },
    )
    core.create_namespaced_service(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo"},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )

    def ready() -> str | None:
        pod = core.read_namespaced_pod("echo-0", namespace)
        ok = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        return str(pod.spec.node_name) if ok else None

    return str(wait_until(ready, timeout=60, what="pod echo-0 Ready on a kwok node"))


def test_port_forward_reaches_a_host_server_through_the_api_server_and_kwok(
    cluster: Cluster, kube_api: client.ApiClient, namespace: str, host_server: tuple[int, type[Answers]]
) -> None:
    port, answers = host_server
    node = kwok_pod_behind_a_service(kube_api, namespace)
    assert node.startswith("kwok-node-")
    sdk = Client(namespace=namespace, kubeconfig=cluster.kubeconfig)
    assert isinstance(sdk.access, PortForward)  # the default outside a cluster
    url = f"http://echo.{namespace}.svc/v2/health/ready"

    # No PortForward object for the pod: kwok's kubelet server opens the stream, then has nowhere to send it.
    with sdk.access.open(url) as local, pytest.raises(httpx.HTTPError):
        httpx.get(local, timeout=10, trust_env=False)
    assert answers.paths == []

    client.CustomObjectsApi(kube_api).create_namespaced_custom_object(
        "kwok.x-k8s.io",
        "v1alpha1",
        namespace,
        "portforwards",
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "PortForward",
            "metadata": {"name": "echo-0"},  # the pod's name: kwok matches the pod by name and namespace
            "spec": {"forwards": [{"ports": [POD_PORT], "target": {"address": "127.0.0.1", "port": port}}]},
        },
    )

    def answered() -> httpx.Response | None:
        # kwok's informer sees the new object within moments; until then the request fails as above.
        with sdk.access.open(url) as local:
            assert local.startswith("http://127.0.0.1:") and not local.endswith(f":{port}/v2/health/ready")
            try:
                return httpx.get(local, timeout=10, trust_env=False)
            except httpx.HTTPError:
                return None

    response = wait_until(answered, timeout=60, what="a request answered through the port-forward", interval=1)
    assert response.status_code == 200
    assert response.text == f"{answers.token} /v2/health/ready"
    assert "/v2/health/ready" in answers.paths
