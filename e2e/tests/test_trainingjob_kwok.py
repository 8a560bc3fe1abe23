"""TrainingJob on the real control plane with kwok GPU nodes: children, status, recovery, suspend, scheduling.

kwok pretends to run the pods, so these tests check what the operator does (objects, status, restarts),
not training itself (test_trainingjob_training.py does that on the node agent).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import KWOK_TOLERATION, kwok_placement
from loom.e2e.pytest_operator import OperatorProcess, operator_process
from loom.workloads.trainer.config import TrainerConfig

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]


def training_job(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
        "maxSteps": 100,
        "workers": {
            "replicas": 2,
            "gpusPerWorker": 1,
            **kwok_placement(),
        },
        "checkpoint": {"uri": "s3://loom-e2e/ckpt", "secretRef": {"name": "s3-credentials"}},
    }
    body.update(spec)
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": body}


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(obj))


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else None


def job_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    job = get(cluster, namespace, "trainingjob", name) or {}
    return dict(job.get("status") or {})


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def pods(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"loom.dev/trainingjob={job}", "-o", "json").stdout
    return list(json.loads(out)["items"])


def wait_phase(
    cluster: Cluster, op: OperatorProcess, namespace: str, name: str, phase: str, timeout: float = 90
) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        status = job_status(cluster, namespace, name)
        return status if status.get("phase") == phase else None

    try:
        return wait_until(reached, timeout=timeout, what=f"TrainingJob {name} phase {phase}", interval=0.5)
    except TimeoutError as error:
        raise AssertionError(f"{error}; status {job_status(cluster, namespace, name)}\n{op.log_tail()}") from None


def fail_pod(cluster: Cluster, namespace: str, name: str, exit_code: int) -> None:
    """What a kubelet reports when the container exits: the pod is Failed with the container's exit code."""
    patch = {
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "image": "loom/trainer:0.1.0",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}},
                }
            ],
        }
    }
    cluster.kubectl(
        "patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(patch)
    )


def test_reconciles_to_running_with_correct_children(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    apply(cluster, ns, training_job("gpt"))
    status = wait_phase(cluster, loom_operator, ns, "gpt", "Running")
    assert status["workers"] == {"desired": 2, "ready": 2}
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Created")["status"] == "True"
    job = get(cluster, ns, "trainingjob", "gpt")
    assert job is not None
    assert status["observedGeneration"] == job["metadata"]["generation"]

    svc = get(cluster, ns, "service", "gpt-workers")
    assert svc is not None
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    cm = get(cluster, ns, "configmap", "gpt-trainer")
    assert cm is not None
    config = TrainerConfig.from_json(cm["data"]["config.json"])
    assert config.training.max_steps == 100 and config.training.device == "cuda"

    workers = sorted(pods(cluster, ns, "gpt"), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"] for p in workers] == ["gpt-worker-0", "gpt-worker-1"]
    for index, pod in enumerate(workers):
        assert pod["spec"]["hostname"] == f"gpt-worker-{index}" and pod["spec"]["subdomain"] == "gpt-workers"
        assert pod["metadata"]["labels"]["loom.dev/attempt"] == "0"
        assert pod["spec"]["restartPolicy"] == "Never"
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")
        assert f"--rdzv-endpoint=gpt-worker-0.gpt-workers.{ns}.svc:29400" in container["command"]
        assert f"--rdzv-id={job['metadata']['uid']}" in container["command"]
        secret_env = {e["name"]: e for e in container["env"]}["AWS_SECRET_ACCESS_KEY"]
        assert secret_env["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"
        assert pod["spec"]["nodeName"].startswith("kwok-node-")

    printed = cluster.kubectl("get", "ltj", "gpt", "-n", ns).stdout
    assert "Running" in printed

    # A second apply of the same spec changes nothing: no new pods, same uids.
    uids = {p["metadata"]["uid"] for p in workers}
    apply(cluster, ns, training_job("gpt"))
    assert {p["metadata"]["uid"] for p in pods(cluster, ns, "gpt")} == uids


def test_failed_worker_restarts_the_gang_and_counts_one_failure(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    apply(cluster, ns, training_job("flaky", runPolicy={"backoffLimit": 1}))
    wait_phase(cluster, loom_operator, ns, "flaky", "Running")
    fail_pod(cluster, ns, "flaky-worker-1", exit_code=1)

    def restarted() -> dict[str, Any] | None:
        status = job_status(cluster, ns, "flaky")
        attempts = {p["metadata"]["labels"]["loom.dev/attempt"] for p in pods(cluster, ns, "flaky")}
        return (
            status if status.get("phase") == "Running" and attempts == {"1"} and status.get("restarts") == 1 else None
        )

    status = wait_until(restarted, timeout=90, what="gang restart as attempt 1", interval=0.5)
    assert (status["restarts"], status["failures"], status["attempt"]) == (1, 1, 1)
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=flaky", "-o", "json"
    ).stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert "GangRestart" in reasons

    # A second real failure exhausts backoffLimit=1: the job fails with that reason and stops its workers.
    fail_pod(cluster, ns, "flaky-worker-0", exit_code=1)
    failed = wait_phase(cluster, loom_operator, ns, "flaky", "Failed")
    assert condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    assert failed["failures"] == 2
    wait_until(
        lambda: (
            all(
                p["status"].get("phase") == "Failed" or p["metadata"].get("deletionTimestamp")
                for p in pods(cluster, ns, "flaky")
            )
            or not pods(cluster, ns, "flaky")
        ),
        timeout=60,
        what="running workers stopped",
    )


def test_permanent_exit_code_fails_fast(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    apply(cluster, ns, training_job("broken"))
    wait_phase(cluster, loom_operator, ns, "broken", "Running")
    fail_pod(cluster, ns, "broken-worker-0", exit_code=2)
    status = wait_phase(cluster, loom_operator, ns, "broken", "Failed")
    assert condition(status, "Failed")["reason"] == "PermanentError"
    assert status["restarts"] == 0 and status["failures"] == 0


def test_impossible_gpu_request_reports_unschedulable(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    job = training_job("huge", scheduling={"scheduleTimeoutSeconds": 2})
    job["spec"]["workers"]["gpusPerWorker"] = 16
    apply(cluster, ns, job)

    def unschedulable() -> dict[str, Any] | None:
        status = job_status(cluster, ns, "huge")
        return status if condition(status, "Ready").get("reason") == "Unschedulable" else None

    status = wait_until(unschedulable, timeout=60, what="Ready=False reason Unschedulable", interval=0.5)
    assert condition(status, "Ready")["status"] == "False"
    assert "nvidia.com/gpu" in condition(status, "Ready")["message"]
    assert status["phase"] == "Created"


def test_suspend_deletes_workers_and_resume_starts_a_new_attempt(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    apply(cluster, ns, training_job("pausable"))
    wait_phase(cluster, loom_operator, ns, "pausable", "Running")
    cluster.kubectl(
        "patch", "trainingjob", "pausable", "-n", ns, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}'
    )
    wait_until(lambda: not pods(cluster, ns, "pausable"), timeout=90, what="workers deleted on suspend")
    status = wait_phase(cluster, loom_operator, ns, "pausable", "Suspended")
    assert condition(status, "Suspended")["status"] == "True"
    cluster.kubectl(
        "patch", "trainingjob", "pausable", "-n", ns, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}'
    )
    status = wait_phase(cluster, loom_operator, ns, "pausable", "Running")
    assert status["attempt"] == 1 and status["restarts"] == 0
    assert {p["metadata"]["labels"]["loom.dev/attempt"] for p in pods(cluster, ns, "pausable")} == {"1"}


def test_operator_killed_at_any_moment_converges_without_duplicates(
    cluster: Cluster, loom_operator: OperatorProcess, tmp_path: Any
) -> None:
    """SIGKILL the operator, break a worker while it is down, start a new one: exactly one restart."""
    prefix = f"lr{uuid.uuid4().hex[:6]}"
    ns = f"{prefix}-a"
    cluster.kubectl("create", "namespace", ns)
    try:
        wait_until(
            lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
            timeout=30,
            what="default ServiceAccount",
        )
        with operator_process(cluster, tmp_path / "first.log", prefix=prefix) as first:
            apply(cluster, ns, training_job("durable"))
            wait_phase(cluster, first, ns, "durable", "Running")
            uids = {p["metadata"]["uid"] for p in pods(cluster, ns, "durable")}
            first.crash()
        fail_pod(cluster, ns, "durable-worker-1", exit_code=1)
        with operator_process(cluster, tmp_path / "second.log", prefix=prefix) as second:

            def recovered() -> dict[str, Any] | None:
                status = job_status(cluster, ns, "durable")
                current = pods(cluster, ns, "durable")
                fresh = {p["metadata"]["labels"]["loom.dev/attempt"] for p in current} == {"1"}
                return status if status.get("phase") == "Running" and fresh and len(current) == 2 else None

            try:
                status = wait_until(recovered, timeout=120, what="recovery by the restarted operator", interval=0.5)
            except TimeoutError as error:
                raise AssertionError(f"{error}: {job_status(cluster, ns, 'durable')}\n{second.log_tail()}") from None
            assert (status["restarts"], status["failures"], status["attempt"]) == (1, 1, 1)
            assert not uids & {p["metadata"]["uid"] for p in pods(cluster, ns, "durable")}
            # A third operator start on a converged job changes nothing.
            second.crash()
        with operator_process(cluster, tmp_path / "third.log", prefix=prefix):
            time.sleep(3)  # give it the chance to (wrongly) act; nothing below may change
            status = job_status(cluster, ns, "durable")
            assert (status["restarts"], status["failures"], status["attempt"]) == (1, 1, 1)
            assert len(pods(cluster, ns, "durable")) == 2
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def gpu_node(name: str, pool: str) -> dict[str, Any]:
    """A one-GPU kwok node in its own pool (so this test's workers land only on its nodes)."""
    capacity = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, "loom.dev/e2e-pool": pool},
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def test_worker_on_a_node_gone_not_ready_is_moved_elsewhere(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    pool = f"p{uuid.uuid4().hex[:6]}"  # a letter first: kubectl reads a bare 6e1234 as a number
    names = [f"tj-{pool}-{i}" for i in range(3)]
    cluster.kubectl("create", "-f", "-", stdin=yaml.safe_dump_all([gpu_node(n, pool) for n in names]))
    try:
        job = training_job("nomad", workers={"replicas": 2, "minReplicas": 1, "gpusPerWorker": 1})
        job["spec"]["workers"]["nodeSelector"] = {"loom.dev/e2e-pool": pool}
        job["spec"]["workers"]["tolerations"] = [KWOK_TOLERATION]
        apply(cluster, ns, job)
        wait_phase(cluster, loom_operator, ns, "nomad", "Running")
        victim = {p["metadata"]["name"]: p for p in pods(cluster, ns, "nomad")}["nomad-worker-1"]
        lost_node = victim["spec"]["nodeName"]
        # kwok stops heartbeating a node that loses its label: the node controller marks it NotReady.
        cluster.kubectl("label", "node", lost_node, "type-")

        def moved() -> dict[str, Any] | None:
            current = pods(cluster, ns, "nomad")
            status = job_status(cluster, ns, "nomad")
            placed = [p for p in current if not p["metadata"].get("deletionTimestamp")]
            away = len(placed) == 2 and all(p["spec"].get("nodeName") not in (None, lost_node) for p in placed)
            return status if away and status.get("phase") == "Running" else None

        try:
            status = wait_until(moved, timeout=240, what="the worker moved off the NotReady node", interval=1)
        except TimeoutError as error:
            raise AssertionError(f"{error}: {job_status(cluster, ns, 'nomad')}\n{loom_operator.log_tail()}") from None
        # A lost node is a disruption, not the trainer's failure: one recovery, no failure counted.
        assert (status["restarts"], status["failures"]) == (1, 0)
        # Worker 0 kept running (elastic: survivors >= minReplicas), only worker 1 was replaced.
        assert status["attempt"] == 0
    finally:
        cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


def test_success_then_ttl_deletes_children_but_keeps_the_job(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    apply(cluster, ns, training_job("short", runPolicy={"ttlSecondsAfterFinished": 2}))
    wait_phase(cluster, loom_operator, ns, "short", "Running")
    for index in range(2):
        cluster.kubectl(
            "patch",
            "pod",
            f"short-worker-{index}",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(
                {
                    "status": {
                        "phase": "Succeeded",
                        "containerStatuses": [
                            {
                                "name": "trainer",
                                "image": "loom/trainer:0.1.0",
                                "imageID": "",
                                "ready": False,
                                "restartCount": 0,
                                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                            }
                        ],
                    }
                }
            ),
        )
    status = wait_phase(cluster, loom_operator, ns, "short", "Succeeded")
    assert condition(status, "Succeeded")["reason"] == "AllWorkersSucceeded"
    assert condition(status, "Ready")["status"] == "True"
    cluster.kubectl("wait", "--for=condition=Succeeded", "trainingjob/short", "-n", ns, "--timeout=10s")

    def cleaned() -> bool:
        return (
            not pods(cluster, ns, "short")
            and get(cluster, ns, "service", "short-workers") is None
            and get(cluster, ns, "configmap", "short-trainer") is None
        )

    wait_until(cleaned, timeout=60, what="children deleted after ttlSecondsAfterFinished")
    final = job_status(cluster, ns, "short")
    assert final["phase"] == "Succeeded" and final["childrenDeleted"] is True
