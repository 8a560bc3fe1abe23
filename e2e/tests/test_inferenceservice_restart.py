"""The operator killed (SIGKILL) in the middle of a canary and of a promotion: a fresh operator converges to the
same plan, with nothing created twice and the previous model version never forgotten.

Pods run on the shared kwok nodes (simulated), so this is about the controller, the API server and the
Deployment controller; its own operator process watches its own namespaces.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import kwok_placement
from loom.e2e.pytest_operator import apply_crds, operator_process
from loom.e2e.rollout_evidence import rollout_evidence

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture
def prefix_and_namespace(cluster: Cluster) -> Iterator[tuple[str, str]]:
    prefix = f"lr{uuid.uuid4().hex[:6]}"
    namespace = f"{prefix}-ns"
    apply_crds(cluster)
    cluster.kubectl("create", "namespace", namespace)
    wait_until(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0,
        timeout=30,
        what="default ServiceAccount",
    )
    yield prefix, namespace
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def get(cluster: Cluster, ns: str, kind: str, name: str | None = None) -> dict[str, Any]:
    args = ["get", kind, *([name] if name else []), "-n", ns, "-o", "json"]
    result = cluster.kubectl(*args, check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def wait_rolled_out(cluster: Cluster, ns: str, reason: str, version: str, log: Path) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", "svc")
        rolled = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}.get("RolledOut", {})
        ok = (
            rolled.get("status") == "True"
            and rolled.get("reason") == reason
            and rolled.get("observedGeneration") == obj["metadata"]["generation"]
            and (obj["status"].get("canary") or {}).get("modelVersion", obj["status"].get("modelVersion")) == version
        )
        return obj if ok else None

    try:
        return dict(wait_until(done, timeout=180, what=f"{reason} with {version}", interval=1))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, "inferenceservice", "svc").get("status"), indent=1)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"{error}\n{status}\n{rollout_evidence(cluster, ns)}\n{tail}") from None


def children(cluster: Cluster, ns: str) -> dict[str, list[str]]:
    found = {}
    for kind in ("deployments", "configmaps", "services"):
        items = get(cluster, ns, kind).get("items", [])
        found[kind] = sorted(
            i["metadata"]["name"]
            for i in items
            if (i["metadata"].get("labels") or {}).get("app.kubernetes.io/managed-by") == "loom-operator"
        )
    return found


def replicas_and_model(cluster: Cluster, ns: str, name: str) -> tuple[int, str]:
    deployment = get(cluster, ns, "deployment", name)
    model = json.loads(deployment["metadata"]["annotations"]["loom.dev/model"])
    return deployment["spec"]["replicas"], model["version"]


def test_killed_operator_resumes_a_canary_and_a_promotion(
    cluster: Cluster, prefix_and_namespace: tuple[str, str], tmp_path: Path
) -> None:
    prefix, ns = prefix_and_namespace
    log = tmp_path / "operator.log"
    body = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc"},
        "spec": {
            "model": {"uri": "s3://models/svc/v1"},
            "handler": "noop",
            "replicas": 5,
            **kwok_placement(),
            "rollout": {"minReadySeconds": 1},
        },
    }
    with operator_process(cluster, log, prefix=prefix) as first:
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
        wait_rolled_out(cluster, ns, "RolledOut", "v1", log)
        canary = {"spec": {"model": {"uri": "s3://models/svc/v2"}, "rollout": {"canaryPercent": 20}}}
        cluster.kubectl("patch", "inferenceservice", "svc", "-n", ns, "--type", "merge", "-p", json.dumps(canary))
        time.sleep(0.3)  # mid-pass, or just before it: either way nothing in memory survives
        first.crash()

    with operator_process(cluster, log, prefix=prefix) as second:
        wait_rolled_out(cluster, ns, "CanaryRolledOut", "v2", log)
        assert replicas_and_model(cluster, ns, "svc") == (4, "v1")  # the previous version stayed stable
        assert replicas_and_model(cluster, ns, "svc-canary") == (1, "v2")
        assert children(cluster, ns) == {
            "deployments": ["svc", "svc-canary"],
            "configmaps": ["svc-canary-config", "svc-config"],
            "services": ["svc"],
        }
        promote = [{"op": "remove", "path": "/spec/rollout/canaryPercent"}]
        cluster.kubectl("patch", "inferenceservice", "svc", "-n", ns, "--type", "json", "-p", json.dumps(promote))
        time.sleep(0.5)
        second.crash()

    with operator_process(cluster, log, prefix=prefix):
        obj = wait_rolled_out(cluster, ns, "RolledOut", "v2", log)
        assert "canary" not in obj["status"]
        assert replicas_and_model(cluster, ns, "svc") == (5, "v2")
        assert children(cluster, ns) == {"deployments": ["svc"], "configmaps": ["svc-config"], "services": ["svc"]}

        # The scale subresource: `kubectl scale` works on the InferenceService like on a Deployment.
        cluster.kubectl("scale", "inferenceservice", "svc", "-n", ns, "--replicas=3")
        wait_rolled_out(cluster, ns, "RolledOut", "v2", log)
        assert replicas_and_model(cluster, ns, "svc") == (3, "v2")
        scale = json.loads(
            cluster.kubectl(
                "get", "--raw", f"/apis/loom.dev/v1alpha1/namespaces/{ns}/inferenceservices/svc/scale"
            ).stdout
        )
        assert scale["spec"]["replicas"] == 3
        wait_until(
            lambda: get(cluster, ns, "inferenceservice", "svc")["status"]["replicas"] == 3,
            timeout=60,
            what="3 replicas",
        )
        assert "app.kubernetes.io/instance=svc" in scale["status"]["selector"]
