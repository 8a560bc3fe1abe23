"""spec.vllm.disaggregation against the real API server, scheduler and controllers, on kwok nodes: the operator
renders a prefill and a decode Deployment (role and kv-version labels, the KV connector on the engine, the shared
claim mounted), the picker's config with disaggregation and the Service pointed at the picker, status counting each
pool; switched on, the pools replace the service's Deployment; a new model is a new kv-version in both pools, and
switching disaggregation off leaves one Deployment. Queued by the stack's real Kueue, both pools are admitted as one pod
set, and neither runs before.

kwok stands in for the engine: its pods run no process, so this proves the operator's side (llm/disaggregation.py),
not the KV hand-over, which the real-engine tests of the picker prove (tests/integration, make test-all).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import KWOK_TOLERATION
from loom.e2e.pytest_operator import OperatorProcess

from .test_trainingjob_kueue import QUEUE_LABEL, apply_ns, phases, queue, queued_job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(420)]
__all__ = ["queue"]  # the fixture, shared with the TrainingJob tests

NAME = "split"
CLAIM = "kv-shared"
ROLE = "loom.dev/role"
KV_VERSION = "loom.dev/kv-version"
KV_ARG = "--engine-arg=--kv-transfer-config="


def service(model: str = "v1", split: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": f"s3://models/split/{model}"},
            "vllm": {"disaggregation": {"kvStorage": {"claimName": CLAIM}, "prefill": {"replicas": 1},
                                        "decode": {"replicas": 2}}} if split else {},
            "nodeSelector": {"type": "kwok"},
            "tolerations": [KWOK_TOLERATION],
        },
    }  # fmt: skip


def shared_volume(namespace: str, volume: str) -> list[dict[str, Any]]:
    """A ReadWriteMany claim bound to a volume made for it (kwok mounts nothing: the NFS server is never asked)."""
    return [
        {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "nfs": {"server": "192.0.2.1", "path": "/kv"},
                     "claimRef": {"namespace": namespace, "name": CLAIM}},
        },
        {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                     "resources": {"requests": {"storage": "1Gi"}}},
        },
    ]  # fmt: skip


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def pool_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={NAME},{ROLE}",
                          "-o", "json")  # fmt: skip
    return [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def ready_pod(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def serving(cluster: Cluster, op: OperatorProcess, ns: str, version: str | None = None) -> dict[str, Any]:
    """Ready with both pools whole (every pod ready; of `version` when given, else of one kv-version)."""

    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", NAME)
        st = obj.get("status") or {}
        conds = {c["type"]: c for c in st.get("conditions", [])}
        split = st.get("disaggregation") or {}
        pods = pool_pods(cluster, ns)
        versions = {p["metadata"]["labels"][KV_VERSION] for p in pods}
        ok = (
            conds.get("Ready", {}).get("status") == "True"
            and conds.get("Ready", {}).get("observedGeneration") == obj["metadata"]["generation"]
            and conds.get("RolledOut", {}).get("status") == "True"
            and split.get("prefill", {}).get("readyReplicas") == 1
            and split.get("decode", {}).get("readyReplicas") == 2
            and len(pods) == 3 and all(ready_pod(p) for p in pods)
            and versions == ({version} if version else {split.get("kvVersion")})
        )
        return obj if ok else None

    try:
        return wait_until(done, timeout=180, what=f"{NAME} Ready with both pools", interval=1)
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", "--show-labels", check=False).stdout
        status = json.dumps(get(cluster, ns, "inferenceservice", NAME).get("status"), indent=1)
        raise AssertionError(f"{error}\n{status}\n{pods}\n{op.log_tail()}") from None


def server(pod_spec: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in pod_spec["containers"] if c["name"] == "server")
    return found


def test_a_disaggregated_service_runs_two_pools_behind_its_picker_and_rolls_them_to_one_version(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns, volume = operator_namespace, f"kv-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(shared_volume(ns, volume)))
    try:
        # One Deployment first; disaggregation switched on replaces it by the two pools.
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service(split=False)))
        wait_until(lambda: (get(cluster, ns, "deployment", NAME).get("status") or {}).get("readyReplicas") == 1,
                   timeout=120, what="the one Deployment ready")  # fmt: skip
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service()))
        obj = serving(cluster, loom_operator, ns)
        split = obj["status"]["disaggregation"]
        assert (split["prefill"]["replicas"], split["decode"]["replicas"]) == (1, 2)
        ready_message = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")["message"]
        assert ready_message.endswith("prefill 1/1 ready, decode 2/2 ready")
        # The printer columns (kubectl aligns each under its header; other columns may be blank or hold spaces).
        header, row = cluster.kubectl("get", "inferenceservice", NAME, "-n", ns, "-o", "wide").stdout.splitlines()[:2]
        prefill_at, decode_at = header.index("PREFILL"), header.index("DECODE")
        assert row[prefill_at:decode_at].strip() == "1" and row[decode_at:].split()[0] == "2"

        # Two Deployments instead of the one, each selecting its own pool.
        wait_until(lambda: get(cluster, ns, "deployment", NAME) == {}, timeout=60, what="the one Deployment gone")
        prefill, decode = (get(cluster, ns, "deployment", f"{NAME}-{role}") for role in ("prefill", "decode"))
        assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 2)
        assert prefill["spec"]["selector"]["matchLabels"][ROLE] == "prefill"
        assert decode["spec"]["selector"]["matchLabels"][ROLE] == "decode"
        first = split["kvVersion"]
        pods = pool_pods(cluster, ns)
        assert sorted(p["metadata"]["labels"][ROLE] for p in pods) == ["decode", "decode", "prefill"]
        for pod in pods:
            container = server(pod["spec"])
            kv_args = [a for a in container["command"] if a.startswith(KV_ARG)]
            assert len(kv_args) == 1
            connector = json.loads(kv_args[0].removeprefix(KV_ARG))
            assert connector["kv_connector"] == "ExampleConnector" and connector["kv_role"] == "kv_both"
            assert connector["kv_connector_extra_config"]["shared_storage_path"].endswith(f"/{first}")
            assert "--engine-arg=--no-enable-chunked-prefill" in container["command"]
            claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
                      if "persistentVolumeClaim" in v]  # fmt: skip
            assert claims == [CLAIM]
            assert any(m["name"] == "kv-storage" for m in container["volumeMounts"])

        # The picker pairs them (its config names the two labels) and the Service sends everything to it.
        picker = get(cluster, ns, "deployment", f"{NAME}-picker")
        env = picker["spec"]["template"]["spec"]["containers"][0]["env"]
        config = json.loads(next(e["value"] for e in env if e["name"] == "LOOM_PICKER_CONFIG"))
        assert config["disaggregation"]["roleLabel"] == ROLE
        assert config["disaggregation"]["versionLabel"] == KV_VERSION
        selector = get(cluster, ns, "service", NAME)["spec"]["selector"]
        assert selector["app.kubernetes.io/component"] == "picker"

        # A new model: a new kv-version, in both pools, every pod replaced.
        cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type", "merge", "-p",
                        json.dumps({"spec": {"model": {"uri": "s3://models/split/v2"}}}))  # fmt: skip

        def new_version() -> str | None:
            label = get(cluster, ns, "deployment", f"{NAME}-decode")["spec"]["template"]["metadata"]["labels"]
            return str(label[KV_VERSION]) if label[KV_VERSION] != first else None

        second = wait_until(new_version, timeout=60, what="the decode pool's template on a new kv-version")
        assert get(cluster, ns, "deployment", f"{NAME}-prefill")["spec"]["template"]["metadata"]["labels"][
            KV_VERSION] == second  # fmt: skip
        rolled = serving(cluster, loom_operator, ns, version=second)
        assert rolled["status"]["disaggregation"]["kvVersion"] == second

        # Disaggregation off: one Deployment again, the pools gone, status without them.
        cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type", "merge", "-p",
                        json.dumps({"spec": {"vllm": {"disaggregation": None}}}))  # fmt: skip

        def one_deployment() -> bool:
            pools = [get(cluster, ns, "deployment", f"{NAME}-{role}") for role in ("prefill", "decode")]
            return pools == [{}, {}] and bool(get(cluster, ns, "deployment", NAME))

        wait_until(one_deployment, timeout=120, what="one Deployment instead of the two pools", interval=1)
        wait_until(lambda: not (get(cluster, ns, "inferenceservice", NAME).get("status") or {}).get("disaggregation"),
                   timeout=60, what="status without the pools")  # fmt: skip
        # One replica needs no picker: the Service selects the replica again and the picker goes.
        wait_until(lambda: get(cluster, ns, "service", NAME)["spec"]["selector"].get("app.kubernetes.io/component")
                   == "server", timeout=60, what="the Service back on the replica")  # fmt: skip
        wait_until(lambda: get(cluster, ns, "deployment", f"{NAME}-picker") == {}, timeout=60, what="the picker gone")
    finally:
        cluster.kubectl("delete", "inferenceservice", NAME, "-n", ns, "--wait=true", "--ignore-not-found")
        cluster.kubectl("delete", "pvc", CLAIM, "-n", ns, "--wait=false", "--ignore-not-found")
        cluster.kubectl("delete", "pv", volume, "--wait=false", "--ignore-not-found")


def test_kueue_admits_both_pools_as_one_pod_set_and_neither_runs_before(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, queue: dict[str, str]
) -> None:
    ns, op, volume = operator_namespace, loom_operator, f"kv-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(shared_volume(ns, volume)))
    queued_split = service()
    queued_split["metadata"]["labels"] = {QUEUE_LABEL: "team"}
    spec = queued_split["spec"]
    spec["gpus"] = 8  # a pod of each pool: the queue's 16 GPUs
    spec["vllm"]["disaggregation"]["decode"]["replicas"] = 1
    for key in ("nodeSelector", "tolerations"):  # the admitted flavor gives them
        del spec[key]
    try:
        apply_ns(cluster, ns, queued_job("holder", gpus=16))  # the whole queue
        wait_for(cluster, op, ns, "holder Running", lambda: phases(cluster, ns, ["holder"])["holder"] == "Running")
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(queued_split))

        def queued() -> dict[str, Any] | None:
            st = get(cluster, ns, "inferenceservice", NAME).get("status") or {}
            return st if (st.get("queue") or {}).get("state") == "Queued" and st["queue"].get("workload") else None

        st = wait_for(cluster, op, ns, f"{NAME} Queued", queued)
        workload = get(cluster, ns, "workloads.kueue.x-k8s.io", st["queue"]["workload"])
        assert [p["count"] for p in workload["spec"]["podSets"]] == [2]  # prefill 1 + decode 1, admitted together
        assert pool_pods(cluster, ns) == []  # neither pool runs before admission

        cluster.kubectl("delete", "trainingjob", "holder", "-n", ns)  # its Workload goes with it: quota freed

        def admitted() -> dict[str, Any] | None:
            obj = get(cluster, ns, "inferenceservice", NAME)
            st = obj.get("status") or {}
            ready = next((c for c in st.get("conditions") or [] if c["type"] == "Ready"), {})
            pods = pool_pods(cluster, ns)
            return st if ready.get("status") == "True" and len(pods) == 2 and all(map(ready_pod, pods)) else None

        st = wait_for(cluster, op, ns, f"{NAME} Ready once admitted", admitted, timeout=180)
        assert st["queue"]["state"] == "Admitted" and st["queue"]["flavor"] == queue["flavor"]
        pods = pool_pods(cluster, ns)
        assert sorted(p["metadata"]["labels"][ROLE] for p in pods) == ["decode", "prefill"]
        for pod in pods:  # on the admitted flavor's nodes, through the flavor alone
            assert pod["spec"]["nodeSelector"] == {"type": "kwok"} and KWOK_TOLERATION in pod["spec"]["tolerations"]
    finally:
        cluster.kubectl("delete", "inferenceservice", NAME, "-n", ns, "--wait=true", "--ignore-not-found")
        cluster.kubectl("delete", "pvc", CLAIM, "-n", ns, "--wait=false", "--ignore-not-found")
        cluster.kubectl("delete", "pv", volume, "--wait=false", "--ignore-not-found")
