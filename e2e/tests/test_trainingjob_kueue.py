"""TrainingJobs queued by the real Kueue (the stack's, from its Go module) on kwok GPU nodes.

A ClusterQueue of 16 GPUs and three TrainingJobs of 8 GPUs each: two are admitted and run, the third waits Queued
with no worker pod and starts when one of the two finishes. Kueue's ResourceFlavor carries the kwok nodes' label
and taint toleration, and the jobs name neither: their workers reach the kwok nodes only through the admitted
flavor. Then priorities: a high-priority job preempts a low-priority one, which stops, requeues (no restart
counted) and runs again once the high-priority job is done.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import KWOK_TOLERATION
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret
from loom.operator.core.model import parse_time

from .test_trainingjob_kwok import get, job_status, pods
from .test_trainingjob_training import committed_steps, events, job, wait_finished, worker_logs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE = "kueue.x-k8s.io/v1beta2"


def apply(cluster: Cluster, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(objects))


@pytest.fixture
def queue(cluster: Cluster, operator_namespace: str) -> Iterator[dict[str, str]]:
    """A ResourceFlavor for the kwok GPU nodes, a ClusterQueue of 16 GPUs on it (lower priorities preempted), and a
    LocalQueue in the test's namespace."""
    suffix = uuid.uuid4().hex[:6]
    names = {"flavor": f"kwok-gpu-{suffix}", "cluster_queue": f"gpus-{suffix}", "local_queue": "team"}
    flavor = {
        "apiVersion": KUEUE,
        "kind": "ResourceFlavor",
        "metadata": {"name": names["flavor"]},
        "spec": {"nodeLabels": {"type": "kwok"}, "tolerations": [KWOK_TOLERATION]},
    }
    cluster_queue = {
        "apiVersion": KUEUE,
        "kind": "ClusterQueue",
        "metadata": {"name": names["cluster_queue"]},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [
                        {"name": names["flavor"], "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 16}]}
                    ],
                }
            ],
        },
    }
    local_queue = {
        "apiVersion": KUEUE,
        "kind": "LocalQueue",
        "metadata": {"name": names["local_queue"], "namespace": operator_namespace},
        "spec": {"clusterQueue": names["cluster_queue"]},
    }
    apply(cluster, flavor, cluster_queue, local_queue)
    try:
        yield names
    finally:
        cluster.kubectl("delete", "trainingjobs", "--all", "-n", operator_namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "localqueue", "team", "-n", operator_namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterqueue", names["cluster_queue"], "--wait=false", check=False)
        cluster.kubectl("delete", "resourceflavor", names["flavor"], "--wait=false", check=False)


def queued_job(name: str, gpus: int = 8, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Two workers of gpus/2 GPUs each; no node selector or toleration of its own (the flavor gives them)."""
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: "team", **(labels or {})}},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
            "maxSteps": 100,
            "workers": {"replicas": 2, "gpusPerWorker": gpus // 2},
            "checkpoint": {"uri": "s3://loom-e2e/ckpt", "secretRef": {"name": "s3-credentials"}},
        },
    }


def phases(cluster: Cluster, namespace: str, names: list[str]) -> dict[str, str | None]:
    return {name: job_status(cluster, namespace, name).get("phase") for name in names}


def wait_for(cluster: Cluster, op: OperatorProcess, namespace: str, what: str, check: Any, timeout: float = 120) -> Any:
    try:
        return wait_until(check, timeout=timeout, what=what, interval=0.5)
    except TimeoutError as error:
        out = cluster.kubectl("get", "trainingjobs,workloads", "-n", namespace, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\n{out}\n{op.log_tail()}") from None


def succeed_workers(cluster: Cluster, namespace: str, job: str) -> None:
    """What a kubelet reports when both trainers exit 0 (kwok runs no process)."""
    for pod in pods(cluster, namespace, job):
        patch = {
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
        name = pod["metadata"]["name"]
        cluster.kubectl(
            "patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(patch)
        )


def workload_of(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    status = job_status(cluster, namespace, job)
    name = (status.get("queue") or {}).get("workload")
    assert name, status
    found = get(cluster, namespace, "workloads.kueue.x-k8s.io", name)
    assert found is not None
    return found


@pytest.mark.integration
def test_a_queue_of_16_gpus_runs_two_8_gpu_jobs_and_starts_the_third_when_one_finishes(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, queue: dict[str, str]
) -> None:
    ns, op = operator_namespace, loom_operator
    names = ["first", "second", "third"]
    for name in names:
        apply_ns(cluster, ns, queued_job(name))

    def two_running_one_queued() -> dict[str, str | None] | None:
        now = phases(cluster, ns, names)
        running = [n for n, p in now.items() if p == "Running"]
        queued = [n for n, p in now.items() if p == "Queued"]
        return now if len(running) == 2 and len(queued) == 1 else None

    now = wait_for(cluster, op, ns, "two jobs Running, one Queued", two_running_one_queued)
    [waiting] = [n for n, p in now.items() if p == "Queued"]
    running = [n for n in names if n != waiting]
    assert pods(cluster, ns, waiting) == []  # held: no worker before admission
    status = job_status(cluster, ns, waiting)
    assert status["queue"]["state"] == "Queued" and status["queue"]["name"] == "team"
    assert "nvidia.com/gpu" in (status["queue"].get("message") or "")  # Kueue's word on why it waits
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Queued"
    for name in running:
        admitted = job_status(cluster, ns, name)["queue"]
        assert admitted["state"] == "Admitted"
        assert (admitted["clusterQueue"], admitted["flavor"]) == (queue["cluster_queue"], queue["flavor"])
        for pod in pods(cluster, ns, name):  # on the flavor's nodes, through the flavor alone
            assert pod["spec"]["nodeSelector"] == {"type": "kwok"}
            assert KWOK_TOLERATION in pod["spec"]["tolerations"]
            assert pod["spec"]["nodeName"].startswith("kwok-node-")

    succeed_workers(cluster, ns, running[0])
    wait_for(cluster, op, ns, f"{waiting} Running", lambda: phases(cluster, ns, [waiting])[waiting] == "Running")
    assert job_status(cluster, ns, running[0])["phase"] == "Succeeded"
    finished = workload_of(cluster, ns, running[0])
    assert any(c["type"] == "Finished" and c["status"] == "True" for c in finished["status"]["conditions"])
    assert job_status(cluster, ns, waiting)["queue"]["state"] == "Admitted"
    assert len(pods(cluster, ns, waiting)) == 2


def apply_ns(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(obj))


@pytest.mark.integration
def test_a_high_priority_job_preempts_a_low_one_which_requeues_without_a_restart_and_runs_again(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, queue: dict[str, str]
) -> None:
    ns, op = operator_namespace, loom_operator
    suffix = uuid.uuid4().hex[:6]
    low, high = f"low-{suffix}", f"high-{suffix}"
    apply(
        cluster,
        {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": low}, "value": 10},
        {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": high}, "value": 1000},
    )
    try:
        priority = "kueue.x-k8s.io/priority-class"
        apply_ns(cluster, ns, queued_job("background", gpus=16, labels={priority: low}))
        wait_for(
            cluster,
            op,
            ns,
            "background Running",
            lambda: phases(cluster, ns, ["background"])["background"] == "Running",
        )
        apply_ns(cluster, ns, queued_job("urgent", gpus=8, labels={priority: high}))

        def preempted() -> dict[str, Any] | None:
            status = job_status(cluster, ns, "background")
            return (
                status
                if (status.get("queue") or {}).get("evictions") == 1 and status.get("phase") == "Queued"
                else None
            )

        wait_for(cluster, op, ns, "background evicted", preempted)
        wait_for(cluster, op, ns, "urgent Running", lambda: phases(cluster, ns, ["urgent"])["urgent"] == "Running")
        status = job_status(cluster, ns, "background")
        eviction = status["queue"]["lastEviction"]
        assert eviction["reason"] == "Preempted" and eviction.get("stoppedTime")
        assert status["restarts"] == 0 and status["failures"] == 0
        assert [p for p in pods(cluster, ns, "background") if not p["metadata"].get("deletionTimestamp")] == []
        assert workload_of(cluster, ns, "urgent")["spec"]["priority"] == 1000

        succeed_workers(cluster, ns, "urgent")
        wait_for(
            cluster,
            op,
            ns,
            "background Running again",
            lambda: phases(cluster, ns, ["background"])["background"] == "Running",
        )
        status = job_status(cluster, ns, "background")
        assert status["restarts"] == 0 and status["queue"]["evictions"] == 1 and status["attempt"] == 1
        assert {p["metadata"]["labels"]["loom.dev/attempt"] for p in pods(cluster, ns, "background")} == {"1"}
        reasons = cluster.kubectl(
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            "involvedObject.name=background",
            "-o",
            "jsonpath={.items[*].reason}",
        ).stdout.split()
        assert {"Queued", "Admitted", "Evicted", "Requeued"} <= set(reasons)
    finally:
        cluster.kubectl("delete", "workloadpriorityclass", low, high, "--wait=false", check=False)


@pytest.mark.integration
def test_the_example_queue_setup_admits_the_example_job_as_written(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns, op = operator_namespace, loom_operator
    examples = Path(__file__).resolve().parents[2] / "examples"
    try:
        for name in ("kueue-gpu-queue.yaml", "trainingjob-queued-gpu.yaml"):
            cluster.kubectl("apply", "-n", ns, "-f", str(examples / name))
        job = "chargpt-queued"
        wait_for(cluster, op, ns, f"{job} Running", lambda: phases(cluster, ns, [job])[job] == "Running")
        status = job_status(cluster, ns, job)
        assert (status["queue"]["state"], status["queue"]["flavor"]) == ("Admitted", "gpu")
        for pod in pods(cluster, ns, job):
            assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert pod["spec"]["nodeName"].startswith("kwok-node-")
        wide = cluster.kubectl("get", "trainingjob", job, "-n", ns, "-o", "wide").stdout
        header, row = wide.split("\n")[:2]
        # kubectl aligns each column under its header: a cell is the row's text from its header's start to the next.
        starts = [(m.start(), m.group()) for m in re.finditer(r"\S+", header)]
        ends = [start for start, _ in starts[1:]] + [len(row)]
        shown = {name: row[start:end].strip() for (start, name), end in zip(starts, ends, strict=True)}
        assert (shown["QUEUE"], shown["ADMISSION"], shown["FLAVOR"]) == ("gpus", "Admitted", "gpu"), wide
    finally:
        cluster.kubectl("delete", "trainingjob", "chargpt-queued", "-n", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterqueue", "gpu-cluster-queue", "--wait=false", check=False)
        cluster.kubectl("delete", "resourceflavor", "gpu", "--wait=false", check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_preempted_job_checkpoints_requeues_and_resumes_from_that_step_to_success(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    bucket: str,
) -> None:
    """Real training on the node agent: a ClusterQueue of 2 CPUs holds a low-priority job of two 1-CPU workers;
    a high-priority job of 2 CPUs preempts it. The low one writes its final checkpoint (the only one: everySteps is
    larger than the run), requeues, and once the high one is done resumes from that step and finishes."""
    ns, op = operator_namespace, loom_operator
    apply_s3_secret(cluster, ns, s3)
    suffix = uuid.uuid4().hex[:6]
    flavor, cq, low, high = f"agent-{suffix}", f"cpus-{suffix}", f"low-{suffix}", f"high-{suffix}"
    apply(
        cluster,
        {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": flavor},
         "spec": {"nodeLabels": {"kubernetes.io/hostname": AGENT_NODE_NAME}}},
        {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": cq}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": ["cpu"],
                                "flavors": [{"name": flavor, "resources": [{"name": "cpu", "nominalQuota": 2}]}]}]}},
        {"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "cpus", "namespace": ns},
         "spec": {"clusterQueue": cq}},
        {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": low}, "value": 10},
        {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": high}, "value": 1000},
    )  # fmt: skip
    try:
        background = training(job("background", "fsdp", bucket, s3, mlflow, max_steps=100), low, cpus="1")
        background["spec"]["checkpoint"]["everySteps"] = 1000  # only the eviction's final checkpoint can exist
        apply_ns(cluster, ns, background)
        wait_until(
            lambda: (job_status(cluster, ns, "background").get("progress") or {}).get("step", 0) >= 10,
            timeout=300,
            what="training past step 10",
            interval=1,
        )
        urgent = training(job("urgent", "fsdp", bucket, s3, mlflow, max_steps=5), high, cpus="1", replicas=2)
        apply_ns(cluster, ns, urgent)

        def requeued() -> dict[str, Any] | None:
            status = job_status(cluster, ns, "background")
            eviction = (status.get("queue") or {}).get("lastEviction") or {}
            return status if eviction.get("stoppedTime") else None

        status = wait_for(cluster, op, ns, "background preempted and requeued", requeued, timeout=240)
        eviction = status["queue"]["lastEviction"]
        # Stopped gracefully (never forced); that the workers checkpointed is what S3 holds.
        assert eviction["reason"] == "Preempted" and eviction.get("checkpointed") is not False, eviction
        saved = committed_steps(s3, bucket, "background")
        assert len(saved) == 1 and 10 <= saved[0] < 100, saved  # the final checkpoint written on eviction
        assert eviction.get("checkpointStep") in (None, saved[0])
        assert status["restarts"] == 0 and status["failures"] == 0
        took = parse_time(eviction["stoppedTime"]) - parse_time(eviction["time"])  # reported, never asserted
        print(f"[kueue] eviction to final checkpoint committed and quota released: {took}", file=sys.__stderr__)

        assert wait_finished(cluster, op, ns, "urgent", timeout=300)["phase"] == "Succeeded"
        final = wait_finished(cluster, op, ns, "background", timeout=400)
        assert final["phase"] == "Succeeded", final
        assert (final["restarts"], final["failures"], final["attempt"]) == (0, 0, 1)
        assert final["queue"]["evictions"] == 1
        resumed = events(worker_logs(cluster, ns, "background-worker-0"), "resume")
        assert resumed and resumed[0]["step"] == saved[0] > 0
    finally:
        cluster.kubectl("delete", "trainingjobs", "--all", "-n", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterqueue", cq, "--wait=false", check=False)
        cluster.kubectl("delete", "resourceflavor", flavor, "--wait=false", check=False)
        cluster.kubectl("delete", "workloadpriorityclass", low, high, "--wait=false", check=False)


def training(manifest: dict[str, Any], priority: str, cpus: str, replicas: int = 2) -> dict[str, Any]:
    """A real training job of the training tier, queued in `cpus` with a priority, each worker asking for `cpus`."""
    manifest["metadata"]["labels"] = {QUEUE_LABEL: "cpus", "kueue.x-k8s.io/priority-class": priority}
    workers = manifest["spec"]["workers"]
    workers.pop("nodeSelector", None)  # the flavor places them on the agent
    workers.update({"replicas": replicas, "resources": {"requests": {"cpu": cpus}}})
    return manifest
