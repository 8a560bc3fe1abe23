"""The local stack is a real Kubernetes cluster: controllers, scheduler, garbage collector and RBAC act."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from loom.devstack.cluster import Cluster, KubectlError
from loom.devstack.cluster.build import KUBERNETES_VERSION
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import GPU_RESOURCE, KWOK_TOLERATION, kwok_placement

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]


def _deployment(name: str, image: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    **kwok_placement(),
                    "containers": [{"name": "main", "image": image, "resources": {"requests": {"cpu": "100m"}}}],
                },
            },
        },
    }


def test_api_server_is_ready_and_of_the_pinned_release(cluster: Cluster) -> None:
    assert cluster.kubectl("get", "--raw", "/readyz").stdout == "ok"
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBERNETES_VERSION
    assert version["clientVersion"]["gitVersion"] == KUBERNETES_VERSION


def test_kwok_nodes_are_ready_with_gpu_capacity(cluster: Cluster, kube_api: client.ApiClient) -> None:
    nodes = client.CoreV1Api(kube_api).list_node(label_selector="type=kwok").items
    stack_nodes = [n for n in nodes if n.metadata.name.startswith("kwok-node-")]
    assert stack_nodes, "the stack created no kwok nodes"
    for node in stack_nodes:
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "True", node.metadata.name
        assert int(node.status.allocatable[GPU_RESOURCE]) > 0
        assert ("kwok.x-k8s.io/node", "fake", "NoSchedule") in {(t.key, t.value, t.effect) for t in node.spec.taints}


def test_deployment_rolls_out_and_rolling_update_completes(cluster: Cluster, namespace: str) -> None:
    manifest = _deployment("web", "loom/e2e-web:v1", replicas=3)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest))
    cluster.kubectl("rollout", "status", "-n", namespace, "deployment/web", "--timeout=120s")

    def pods() -> list[dict[str, Any]]:
        items = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=web", "-o", "json").stdout)
        return [p for p in items["items"] if "deletionTimestamp" not in p["metadata"]]

    first = pods()
    assert len(first) == 3
    assert all(p["spec"]["nodeName"].startswith("kwok-node-") for p in first)
    assert all(p["status"]["phase"] == "Running" for p in first)

    cluster.kubectl("set", "image", "-n", namespace, "deployment/web", "main=loom/e2e-web:v2")
    cluster.kubectl("rollout", "status", "-n", namespace, "deployment/web", "--timeout=120s")
    deployment = json.loads(cluster.kubectl("get", "deployment/web", "-n", namespace, "-o", "json").stdout)
    assert deployment["status"]["updatedReplicas"] == 3
    assert deployment["status"]["availableReplicas"] == 3
    replica_sets = json.loads(cluster.kubectl("get", "rs", "-n", namespace, "-l", "app=web", "-o", "json").stdout)
    by_image = {rs["spec"]["template"]["spec"]["containers"][0]["image"]: rs for rs in replica_sets["items"]}
    assert by_image["loom/e2e-web:v2"]["status"].get("readyReplicas") == 3
    assert by_image["loom/e2e-web:v1"]["spec"]["replicas"] == 0
    wait_until(
        lambda: {p["spec"]["containers"][0]["image"] for p in pods()} == {"loom/e2e-web:v2"},
        timeout=60,
        what="old pods to go away",
    )


def test_deleting_an_owner_garbage_collects_its_dependents(kube_api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"), data={"k": "v"})
    )
    reference = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="dependent", owner_references=[reference]))
    )
    core.create_namespaced_secret(
        namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="dependent", owner_references=[reference]))
    )
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bystander")))

    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def gone(read: Any) -> bool:
        try:
            read("dependent", namespace)
        except ApiException as err:
            return err.status == 404
        return False

    wait_until(lambda: gone(core.read_namespaced_config_map), timeout=60, what="dependent ConfigMap collected")
    wait_until(lambda: gone(core.read_namespaced_secret), timeout=60, what="dependent Secret collected")
    # Only dependents go: an object without the owner reference stays.
    assert core.read_namespaced_config_map("bystander", namespace).metadata.name == "bystander"


@pytest.fixture
def gpu_pool(kube_api: client.ApiClient) -> Iterator[str]:
    """Two private kwok nodes, one with 2 GPUs and one with none, that only this test's pods tolerate.

    Private nodes keep the GPU arithmetic exact even when other tests use the shared kwok nodes.
    """
    core = client.CoreV1Api(kube_api)
    pool = f"gpu-{uuid.uuid4().hex[:6]}"
    names = {"gpu": f"e2e-{pool}-gpu", "cpu": f"e2e-{pool}-cpu"}
    for kind, name in names.items():
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "110"} | ({GPU_RESOURCE: "2"} if kind == "gpu" else {})
        core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"type": "kwok", "loom.dev/e2e-pool": pool}},
                "spec": {
                    "taints": [
                        {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"},
                        {"key": "loom.dev/e2e-pool", "value": pool, "effect": "NoSchedule"},
                    ]
                },
                "status": {"capacity": capacity, "allocatable": capacity},
            }
        )
    try:
        for name in names.values():
            wait_until(
                lambda name=name: any(
                    c.type == "Ready" and c.status == "True" for c in core.read_node(name).status.conditions or []
                ),
                timeout=60,
                what=f"node {name} Ready",
            )
        yield pool
    finally:
        for name in names.values():
            core.delete_node(name)


def _gpu_pod(name: str, pool: str) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_selector={"loom.dev/e2e-pool": pool},
            tolerations=[
                client.V1Toleration(**KWOK_TOLERATION),
                client.V1Toleration(key="loom.dev/e2e-pool", operator="Equal", value=pool, effect="NoSchedule"),
            ],
            containers=[
                client.V1Container(
                    name="main",
                    image="loom/e2e-gpu:v1",
                    resources=client.V1ResourceRequirements(limits={GPU_RESOURCE: "1"}),
                )
            ],
        ),
    )


def test_gpu_pods_land_only_on_gpu_nodes_and_wait_when_none_is_free(
    kube_api: client.ApiClient, namespace: str, gpu_pool: str
) -> None:
    core = client.CoreV1Api(kube_api)

    def node_of(name: str) -> str | None:
        return core.read_namespaced_pod(name, namespace).spec.node_name

    for name in ("gpu-a", "gpu-b"):
        core.create_namespaced_pod(namespace, _gpu_pod(name, gpu_pool))
        node = wait_until(lambda name=name: node_of(name), timeout=60, what=f"pod {name} scheduled")
        # The pool's CPU-only node tolerates the same pods: only the GPU request keeps them off it.
        assert node == f"e2e-{gpu_pool}-gpu"

    core.create_namespaced_pod(namespace, _gpu_pod("gpu-c", gpu_pool))

    def unschedulable() -> str | None:
        pod = core.read_namespaced_pod("gpu-c", namespace)
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False" and condition.reason == "Unschedulable":
                return condition.message
        return None

    message = wait_until(unschedulable, timeout=60, what="gpu-c reported Unschedulable")
    assert f"Insufficient {GPU_RESOURCE}" in message
    pod = core.read_namespaced_pod("gpu-c", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None

    # Freeing a GPU is all it takes: the pending pod then lands on the GPU node.
    core.delete_namespaced_pod("gpu-a", namespace, grace_period_seconds=0)
    node = wait_until(lambda: node_of("gpu-c"), timeout=90, what="gpu-c scheduled after a GPU was freed")
    assert node == f"e2e-{gpu_pool}-gpu"


def _token_kubeconfig(cluster: Cluster, token: str, path: Path) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca_cert)}}
        ],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_service_account_is_refused_what_its_role_does_not_grant(
    cluster: Cluster, kube_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="configmap-reader"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["configmaps"], verbs=["get", "list"])],
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="reader"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="configmap-reader"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)],
        ),
    )
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="visible")))
    token = core.create_namespaced_service_account_token(
        "reader", namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    ).status.token

    env = cluster.env | {"KUBECONFIG": str(_token_kubeconfig(cluster, token, tmp_path / "reader.kubeconfig"))}

    def kubectl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(cluster.bin_dir / "kubectl"), *args], env=env, capture_output=True, text=True)

    whoami = kubectl("-n", namespace, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
    assert whoami.stdout == f"system:serviceaccount:{namespace}:reader", whoami.stderr

    allowed = kubectl("-n", namespace, "get", "configmap", "visible", "-o", "name")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.strip() == "configmap/visible"

    for refused in (
        kubectl("-n", namespace, "get", "secrets"),
        kubectl("-n", namespace, "create", "configmap", "new", "--from-literal=k=v"),
        kubectl("-n", namespace, "delete", "configmap", "visible"),
        kubectl("-n", "default", "get", "configmaps"),
    ):
        assert refused.returncode != 0
        # Refused by authorization (403) for this identity: not a typo, not an authentication failure.
        assert "forbidden" in refused.stderr.lower(), refused.stderr
        assert f'User "system:serviceaccount:{namespace}:reader" cannot' in refused.stderr, refused.stderr
    # The refused delete really changed nothing.
    assert core.read_namespaced_config_map("visible", namespace).metadata.name == "visible"


def test_kubectl_errors_carry_stderr(cluster: Cluster) -> None:
    with pytest.raises(KubectlError, match="NotFound"):
        cluster.kubectl("get", "namespace", f"missing-{uuid.uuid4().hex[:6]}")


def test_helm_installs_and_uninstalls_a_chart(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting }}\n"
    )
    helm = str(cluster.bin_dir / "helm")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([helm, *args], env=cluster.env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result

    assert run("version", "--template", "{{.KubeClientVersion}}").stdout == "v1.37"
    run("install", "probe", str(chart), "-n", namespace, "--set", "greeting=hello", "--wait")
    data = json.loads(cluster.kubectl("get", "configmap", "probe-cm", "-n", namespace, "-o", "json").stdout)["data"]
    assert data == {"greeting": "hello"}
    run("uninstall", "probe", "-n", namespace, "--wait")
    assert cluster.kubectl("get", "configmap", "probe-cm", "-n", namespace, check=False).returncode != 0
