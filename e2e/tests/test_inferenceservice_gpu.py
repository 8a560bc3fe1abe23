"""GPU rollouts against the real scheduler: on a node whose GPUs are all taken by the replicas, Loom's default
(no surge, one replica at a time) completes a model change, while a surge rollout can only wait for a GPU that
never frees up, and the InferenceService says why while the previous model keeps serving.

The node is a private kwok node (its pods are simulated, so only scheduling and Deployment logic are real); a
taint of its own keeps other tests' pods off it, so the GPU arithmetic is exact.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import GPU_RESOURCE, KWOK_TAINT, KWOK_TOLERATION
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture
def gpu_pool(kube_api: client.ApiClient) -> Iterator[str]:
    """One private kwok node with 2 GPUs that only this test's pods tolerate."""
    core = client.CoreV1Api(kube_api)
    pool = f"isvc-{uuid.uuid4().hex[:6]}"
    name = f"e2e-{pool}-gpu"
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", GPU_RESOURCE: "2"}
    core.create_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"type": "kwok", "loom.dev/e2e-pool": pool}},
            "spec": {"taints": [KWOK_TAINT, {"key": "loom.dev/e2e-pool", "value": pool, "effect": "NoSchedule"}]},
            "status": {"capacity": capacity, "allocatable": capacity},
        }
    )
    try:
        wait_until(
            lambda: any(c.type == "Ready" and c.status == "True" for c in core.read_node(name).status.conditions or []),
            timeout=60,
            what=f"node {name} Ready",
        )
        yield pool
    finally:
        core.delete_node(name)


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def wait_serving(cluster: Cluster, op: OperatorProcess, ns: str, name: str, version: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", name)
        conds = conditions(obj)
        rolled = conds.get("RolledOut", {})
        ok = (
            rolled.get("status") == "True"
            and rolled.get("observedGeneration") == obj["metadata"]["generation"]
            and obj["status"].get("modelVersion") == version
        )
        return obj if ok else None

    try:
        return dict(wait_until(done, timeout=180, what=f"{name} serving {version}", interval=1))
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        status = json.dumps(get(cluster, ns, "inferenceservice", name).get("status"), indent=1)
        # What the operator judges the rollout by: the Deployments' and ReplicaSets' own status (CI once saw both
        # pods ready and the service RollingOut for 3 minutes, with no Deployment change reaching the operator).
        sets = cluster.kubectl("get", "deployments,replicasets", "-n", ns, "-o", "yaml", check=False).stdout
        raise AssertionError(f"{error}\n{status}\n{pods}\n{sets}\n{op.log_tail()}") from None


def patch(cluster: Cluster, ns: str, name: str, body: Any, kind: str = "merge") -> None:
    cluster.kubectl("patch", "inferenceservice", name, "-n", ns, "--type", kind, "-p", json.dumps(body))


def test_gpu_rollout_defaults_do_not_deadlock_on_a_full_node(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, gpu_pool: str
) -> None:
    ns = operator_namespace
    body = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "gpu"},
        "spec": {
            "model": {"uri": "s3://models/gpu/v1"},
            "handler": "noop",
            "gpus": 1,
            "replicas": 2,  # both GPUs of the node
            "nodeSelector": {"loom.dev/e2e-pool": gpu_pool},
            "tolerations": [
                KWOK_TOLERATION,
                {"key": "loom.dev/e2e-pool", "operator": "Equal", "value": gpu_pool, "effect": "NoSchedule"},
            ],
            "rollout": {"minReadySeconds": 1},
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
    wait_serving(cluster, loom_operator, ns, "gpu", "v1")
    deployment = get(cluster, ns, "deployment", "gpu")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    server = deployment["spec"]["template"]["spec"]["containers"][0]
    assert server["resources"]["limits"][GPU_RESOURCE] == "1"

    # Every GPU is taken, and still the model change completes: one replica at a time frees its own GPU.
    patch(cluster, ns, "gpu", {"spec": {"model": {"uri": "s3://models/gpu/v2"}}})
    wait_serving(cluster, loom_operator, ns, "gpu", "v2")

    # A surge rollout on the same full node cannot progress: the surge replica waits for a GPU forever.
    patch(
        cluster,
        ns,
        "gpu",
        {"spec": {"model": {"uri": "s3://models/gpu/v3"}, "rollout": {"maxSurge": 1, "maxUnavailable": 0}}},
    )

    def stuck() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", "gpu")
        conds = conditions(obj)
        loaded = conds.get("ModelLoaded", {})
        ok = (
            loaded.get("reason") == "Unschedulable"
            and loaded.get("observedGeneration") == obj["metadata"]["generation"]
            and conds.get("RolledOut", {}).get("status") == "False"
        )
        return obj if ok else None

    obj = wait_until(stuck, timeout=120, what="the surge rollout to report an unschedulable replica", interval=1)
    conds = conditions(obj)
    assert GPU_RESOURCE in conds["ModelLoaded"]["message"]
    assert conds["Ready"]["status"] == "True"  # the previous model keeps serving on both GPUs
    assert obj["status"]["readyReplicas"] == 2 and obj["status"]["phase"] == "RollingOut"

    # Back to the defaults: the same rollout completes.
    patch(
        cluster, ns, "gpu",
        [{"op": "remove", "path": "/spec/rollout/maxSurge"}, {"op": "remove", "path": "/spec/rollout/maxUnavailable"}],
        kind="json",
    )  # fmt: skip
    final = wait_serving(cluster, loom_operator, ns, "gpu", "v3")
    assert final["status"]["readyReplicas"] == 2
