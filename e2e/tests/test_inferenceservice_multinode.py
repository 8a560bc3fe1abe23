"""A vllm InferenceService whose replica is two pods (spec.vllm.parallelism.podsPerReplica: 2) on the stack's real
LeaderWorkerSet controller (devstack/cluster/lws.py) and kwok nodes: the operator renders a LeaderWorkerSet, LWS's
webhook and controller create each group's leader and worker pods, Ready and status.replicas count groups, and
deleting a worker brings the whole group back (a new leader too), after which the service is Ready again.

kwok stands in for the engine: its pods run no process, so this proves the group semantics (the part Loom and LWS
own), not vLLM across pods; e2e/tests/test_inferenceservice_multinode_vllm.py is about the real engine.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import KWOK_TOLERATION
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(420)]

NAME = "big"
GROUP_SET = "big-group"  # the LeaderWorkerSet (llm/multinode.py: not the Service's name)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"


def service(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": "s3://models/big/v1"},
            "replicas": replicas,
            "vllm": {"parallelism": {"tensor": 2, "podsPerReplica": 2}},
            "nodeSelector": {"type": "kwok"},
            "tolerations": [KWOK_TOLERATION],
        },
    }


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def group_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"{LWS_NAME_LABEL}={GROUP_SET}", "-o", "json")
    return [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def serving(cluster: Cluster, op: OperatorProcess, ns: str, groups: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Ready with `groups` ready groups, each a ready leader and worker; the service and its pods."""

    def done() -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        obj = get(cluster, ns, "inferenceservice", NAME)
        st = obj.get("status") or {}
        conds = {c["type"]: c for c in st.get("conditions", [])}
        pods = group_pods(cluster, ns)
        ok = (
            conds.get("Ready", {}).get("status") == "True"
            and conds.get("Ready", {}).get("observedGeneration") == obj["metadata"]["generation"]
            and st.get("readyReplicas") == groups
            and len(pods) == 2 * groups
            and all(ready(p) for p in pods)
        )
        return (obj, pods) if ok else None

    try:
        return wait_until(done, timeout=180, what=f"{NAME} Ready with {groups} group(s)", interval=1)
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", "--show-labels", check=False).stdout
        sets = cluster.kubectl("get", "leaderworkersets,statefulsets", "-n", ns, "-o", "yaml", check=False).stdout
        status = json.dumps(get(cluster, ns, "inferenceservice", NAME).get("status"), indent=1)
        raise AssertionError(f"{error}\n{status}\n{pods}\n{sets[-6000:]}\n{op.log_tail()}") from None


def test_a_two_pod_replica_is_a_group_that_lws_restarts_whole(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service(replicas=1)))
    obj, pods = serving(cluster, loom_operator, ns, groups=1)
    assert obj["status"]["replicas"] == 1  # groups, not pods

    # The operator's LeaderWorkerSet, no Deployment; LWS's webhook numbered the pods and gave them the group's env.
    lws = get(cluster, ns, "leaderworkerset", GROUP_SET)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert get(cluster, ns, "deployment", NAME) == {}
    by_index = {p["metadata"]["labels"][WORKER_INDEX_LABEL]: p for p in pods}
    assert set(by_index) == {"0", "1"}
    leader, worker = by_index["0"], by_index["1"]
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    worker_env = {e["name"]: e.get("value") for c in worker["spec"]["containers"] for e in c.get("env") or []}
    assert worker_env["LWS_LEADER_ADDRESS"].startswith(f"{GROUP_SET}-0.{GROUP_SET}.{ns}")
    # LWS's headless Service for the group's DNS names, beside the InferenceService's own.
    assert get(cluster, ns, "service", GROUP_SET)["spec"]["clusterIP"] == "None"
    # Only the leader is behind the Service.
    by_service = f"kubernetes.io/service-name={NAME}"
    listed = cluster.kubectl("get", "endpointslices", "-n", ns, "-l", by_service, "-o", "json")
    slices = json.loads(listed.stdout)["items"]
    targets = {e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or [] if e.get("targetRef")}
    assert targets == {leader["metadata"]["name"]}

    # A worker lost: LWS recreates the whole group (a new leader as well), and the service is Ready again.
    cluster.kubectl("delete", "pod", worker["metadata"]["name"], "-n", ns, "--wait=false")

    def group_recreated() -> bool:
        now = {p["metadata"]["labels"][WORKER_INDEX_LABEL]: p["metadata"]["uid"] for p in group_pods(cluster, ns)}
        return now.get("0") not in (None, leader["metadata"]["uid"]) and now.get("1") not in (
            None, worker["metadata"]["uid"]
        )

    wait_until(group_recreated, timeout=120, what="the group recreated (leader and worker)", interval=0.5)
    serving(cluster, loom_operator, ns, groups=1)

    # Scaled to two replicas: two groups, four pods; status counts groups.
    cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type", "merge", "-p",
                    json.dumps({"spec": {"replicas": 2}}))  # fmt: skip
    obj, pods = serving(cluster, loom_operator, ns, groups=2)
    assert obj["status"]["replicas"] == 2
    assert {p["metadata"]["labels"][GROUP_INDEX_LABEL] for p in pods} == {"0", "1"}

    # Back to one pod per replica: a Deployment again, the LeaderWorkerSet gone.
    cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type", "merge", "-p",
                    json.dumps({"spec": {"vllm": {"parallelism": None}}}))  # fmt: skip

    def single_pods() -> bool:
        return get(cluster, ns, "leaderworkerset", GROUP_SET) == {} and bool(get(cluster, ns, "deployment", NAME))

    wait_until(single_pods, timeout=120, what="a Deployment instead of the LeaderWorkerSet", interval=1)
