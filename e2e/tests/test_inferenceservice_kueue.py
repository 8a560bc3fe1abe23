"""An InferenceService queued by the real Kueue (the stack's) on kwok GPU nodes, sharing a 16-GPU ClusterQueue with a
TrainingJob: the service waits Queued with no replica while the job holds the quota, becomes Ready once the job is
gone, on the admitted flavor's nodes; asked for more replicas than the quota holds, it runs what Kueue admits (its
scale steps) and says what waits.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.nodes import KWOK_TOLERATION
from loom.e2e.pytest_operator import OperatorProcess

from .test_trainingjob_kueue import QUEUE_LABEL, apply_ns, phases, queue, queued_job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(420)]
__all__ = ["queue"]  # the fixture, shared with the TrainingJob tests


def service(name: str) -> dict[str, Any]:
    """8 GPUs per replica, autoscaled 1..3 (a patch of spec.replicas stands in for the autoscaler here); no node
    selector or toleration of its own: the admitted flavor gives them."""
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: "team"}},
        "spec": {
            "model": {"uri": "s3://models/queued/v1"},
            "handler": "noop",
            "gpus": 8,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "metric": "concurrency", "target": 10},
        },
    }


def status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", "inferenceservice", name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout).get("status") or {}) if result.returncode == 0 else {}


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == kind), {})


def service_pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"loom.dev/inferenceservice={name}", "-o", "json")
    return [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def test_a_service_waits_for_quota_then_serves_and_runs_only_the_scale_steps_kueue_admits(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, queue: dict[str, str]
) -> None:
    ns, op = operator_namespace, loom_operator
    try:
        apply_ns(cluster, ns, queued_job("holder", gpus=16))  # the whole queue
        wait_for(cluster, op, ns, "holder Running", lambda: phases(cluster, ns, ["holder"])["holder"] == "Running")
        cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service("chat")))

        def queued() -> dict[str, Any] | None:
            st = status(cluster, ns, "chat")
            # Queued first with Loom's own words, then with Kueue's on why it waits (which quota is short).
            said = "nvidia.com/gpu" in ((st.get("queue") or {}).get("message") or "")
            return st if (st.get("queue") or {}).get("state") == "Queued" and said else None

        st = wait_for(cluster, op, ns, "chat Queued, Kueue saying why", queued)
        assert condition(st, "Ready")["status"] == "False" and condition(st, "Ready")["reason"] == "Queued"
        assert service_pods(cluster, ns, "chat") == []  # no replica before admission

        cluster.kubectl("delete", "trainingjob", "holder", "-n", ns)  # its Workload goes with it: quota freed

        def ready() -> dict[str, Any] | None:
            st = status(cluster, ns, "chat")
            return st if condition(st, "Ready").get("status") == "True" else None

        st = wait_for(cluster, op, ns, "chat Ready once admitted", ready, timeout=180)
        assert (st["queue"]["state"], st["queue"]["clusterQueue"]) == ("Admitted", queue["cluster_queue"])
        assert st["queue"]["flavor"] == queue["flavor"] and st["readyReplicas"] == 1
        [pod] = service_pods(cluster, ns, "chat")  # on the flavor's nodes, through the flavor alone
        assert pod["spec"]["nodeSelector"] == {"type": "kwok"} and KWOK_TOLERATION in pod["spec"]["tolerations"]

        # Asked for 3 replicas of 8 GPUs in a queue of 16: one scale step is admitted, the other waits, and says so.
        # (What the autoscaler writes; through the object here: the scale subresource needs spec.replicas set.)
        replicas = json.dumps({"spec": {"replicas": 3}})
        cluster.kubectl("patch", "inferenceservice", "chat", "-n", ns, "--type=merge", "-p", replicas)

        def limited() -> dict[str, Any] | None:
            st = status(cluster, ns, "chat")
            scale = condition(st, "ScaleAdmitted")
            return st if scale.get("reason") == "WaitingForQuota" and st.get("readyReplicas") == 2 else None

        st = wait_for(cluster, op, ns, "two replicas admitted, one scale step waiting", limited, timeout=180)
        assert (st["queue"]["requestedReplicas"], st["queue"]["admittedReplicas"], st["queue"]["queuedSteps"]) == (
            3,
            2,
            1,
        )
        assert "asks for 3 replica(s), Kueue admitted 2" in condition(st, "ScaleAdmitted")["message"]
        assert len(service_pods(cluster, ns, "chat")) == 2
    finally:
        cluster.kubectl("delete", "inferenceservices", "--all", "-n", ns, "--wait=false", check=False)
