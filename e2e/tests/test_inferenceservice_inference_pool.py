"""spec.routing.inferencePool against the real API server with GIE's own InferencePool CRD (installed by the local
stack from GIE's Go module, devstack/cluster/gie.py): a vllm InferenceService with routing gets an InferencePool
the CRD's schema and CEL rules accept (its replicas' labels, their port, the picker's gRPC Service as
endpointPickerRef, the failure mode) and names it in status; an InferencePool a user made under that name is
never written, and a condition says so. kwok nodes: no pod really runs (the picker's ext_proc side is tested through
a real Envoy in tests/integration/test_picker_envoy.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]

POOL = "inferencepools.inference.networking.k8s.io"


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def apply(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))


def service(name: str, **pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"runtime": "vllm", "model": {"uri": f"s3://models/{name}/v1"}, "replicas": 2,
                 "routing": {"policy": "prefix-cache", "inferencePool": pool}},
    }


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_a_routed_vllm_service_gets_an_inference_pool_named_in_status(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns, name = operator_namespace, f"pool-{uuid.uuid4().hex[:6]}"
    apply(cluster, ns, service(name, failureMode="FailOpen"))
    wait_until(lambda: get(cluster, ns, "inferenceservice", name).get("status", {}).get("inferencePool") == name,
               timeout=120, what="status.inferencePool")
    pool = get(cluster, ns, POOL, name)
    isvc = get(cluster, ns, "inferenceservice", name)
    assert pool["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": "inferenceservice",
                                               "app.kubernetes.io/instance": name,
                                               "app.kubernetes.io/component": "server"}
    assert spec["targetPorts"] == [{"number": 8080}]
    assert spec["endpointPickerRef"] == {"group": "", "kind": "Service", "name": f"{name}-picker",
                                         "port": {"number": 9002}, "failureMode": "FailOpen"}
    # The picker's Service has the gRPC port the pool names, and its Deployment's pod listens on it.
    picker_service = get(cluster, ns, "service", f"{name}-picker")
    assert [(p["name"], p["port"], p.get("appProtocol")) for p in picker_service["spec"]["ports"]] == [
        ("grpc", 9002, "kubernetes.io/h2c")]
    container = get(cluster, ns, "deployment", f"{name}-picker")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": 9002, "protocol": "TCP"} in container["ports"]
    assert json.loads(next(e["value"] for e in container["env"] if e["name"] == "LOOM_PICKER_CONFIG"))[
        "extProcPort"] == 9002
    ready = condition(isvc, "InferencePool")
    assert (ready["status"], ready["reason"]) == ("True", "Applied")

    # No longer asked for: the pool and the picker's gRPC Service go, and status forgets them.
    cluster.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=json",
                    "-p", json.dumps([{"op": "remove", "path": "/spec/routing/inferencePool"}]))
    wait_until(lambda: not get(cluster, ns, POOL, name), timeout=120, what="the pool deleted")
    wait_until(lambda: not get(cluster, ns, "service", f"{name}-picker"), timeout=60, what="picker Service deleted")
    final = get(cluster, ns, "inferenceservice", name)
    assert not final["status"].get("inferencePool") and not condition(final, "InferencePool")


def test_a_users_inference_pool_is_never_overwritten(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns, name = operator_namespace, f"mine-{uuid.uuid4().hex[:6]}"
    users = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": "my-own-servers"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "my-own-epp", "port": {"number": 9002}}},
    }
    apply(cluster, ns, users)
    before = get(cluster, ns, POOL, name)
    apply(cluster, ns, service(name))
    wait_until(lambda: condition(get(cluster, ns, "inferenceservice", name), "InferencePool").get("reason")
               == "NotOwned", timeout=120, what="condition InferencePool NotOwned")
    isvc = get(cluster, ns, "inferenceservice", name)
    cond = condition(isvc, "InferencePool")
    assert cond["status"] == "False" and "not made by this InferenceService" in cond["message"]
    assert not isvc["status"].get("inferencePool")
    after = get(cluster, ns, POOL, name)
    assert after["spec"] == before["spec"] and not after["metadata"].get("ownerReferences")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    # Deleting the service leaves the user's pool alone too.
    cluster.kubectl("delete", "inferenceservice", name, "-n", ns, "--wait=true")
    assert get(cluster, ns, POOL, name)["metadata"]["uid"] == before["metadata"]["uid"]
