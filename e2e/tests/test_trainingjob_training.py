"""TrainingJobs that really train: 2 workers on the node agent run the bundled character-level GPT under
torchrun, checkpoint to the real S3 server, log to the real MLflow server, and survive a killed worker.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import psutil
import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

TINY_MODEL = ["nLayer=2", "nEmbd=64", "nHead=4", "blockSize=32"]


def job(name: str, engine: str, bucket: str, s3: S3Endpoint, mlflow: MLflowEndpoint, max_steps: int) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "engine": engine,
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task", "args": TINY_MODEL},
        "maxSteps": max_steps,
        "env": [
            {"name": "OMP_NUM_THREADS", "value": "1"},
            {"name": "DS_ACCELERATOR", "value": "cpu"},
            {"name": "AWS_DEFAULT_REGION", "value": s3.region},
        ],
        "workers": {"replicas": 2, "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}},
        "checkpoint": {
            "uri": f"s3://{bucket}/{name}",
            "endpoint": s3.url,
            "secretRef": {"name": "s3-credentials"},
            "everySteps": 10,
            "keepLast": 2,
        },
        "tracking": {"mlflow": {"trackingUri": mlflow.url, "experiment": "loom-e2e"}},
        "runPolicy": {"backoffLimit": 2},
    }
    if engine == "deepspeed":
        spec["deepspeed"] = {"zeroStage": 2}
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": spec}


def status_of(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "trainingjob", name, "-n", namespace, "-o", "json").stdout
    return dict(json.loads(out).get("status") or {})


def wait_finished(cluster: Cluster, op: OperatorProcess, namespace: str, name: str, timeout: float) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        status = status_of(cluster, namespace, name)
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    try:
        return wait_until(finished, timeout=timeout, what=f"TrainingJob {name} to finish", interval=1)
    except TimeoutError as error:
        raise AssertionError(f"{error}: {status_of(cluster, namespace, name)}\n{op.log_tail()}") from None


def worker_logs(cluster: Cluster, namespace: str, pod: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, pod, check=False).stdout


def events(text: str, kind: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        start = line.find('{"event"')
        if start >= 0:
            try:
                event = json.loads(line[start:])
            except json.JSONDecodeError:
                continue
            if event.get("event") == kind:
                found.append(event)
    return found


def committed_steps(s3: S3Endpoint, bucket: str, prefix: str) -> list[int]:
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    steps = []
    for obj in listing.get("Contents", []):
        parts = obj["Key"].split("/")
        if parts[-1] == "manifest.json" and parts[-2].startswith("step-"):
            steps.append(int(parts[-2].removeprefix("step-")))
    return sorted(steps)


def mlflow_losses(mlflow: MLflowEndpoint, run_id: str) -> dict[int, float]:
    response = httpx.get(
        f"{mlflow.url}/api/2.0/mlflow/metrics/get-history",
        params={"run_id": run_id, "metric_key": "loss", "max_results": 10000},
        timeout=10,
        trust_env=False,
    )
    response.raise_for_status()
    return {m["step"]: m["value"] for m in response.json().get("metrics", [])}


def assert_trained(
    cluster: Cluster, s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, name: str, status: dict[str, Any], steps: int
) -> None:
    assert status["phase"] == "Succeeded", status
    assert status["progress"]["step"] == steps
    assert status["checkpoint"]["latest"].startswith(f"s3://{bucket}/{name}/step-")
    # The final checkpoint commits after the last progress poll; the trainer's exit message still reports it.
    assert status["checkpoint"]["step"] == steps, status["checkpoint"]
    assert max(committed_steps(s3, bucket, name)) == steps
    assert committed_steps(s3, bucket, name), "no complete checkpoint in S3"
    run_id = status["mlflow"]["runId"]
    assert status["mlflow"]["url"].endswith(run_id)
    run = httpx.get(f"{mlflow.url}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10, trust_env=False)
    assert run.json()["run"]["info"]["status"] == "FINISHED"  # closed by the operator when the job succeeded
    losses = mlflow_losses(mlflow, run_id)
    assert losses, "no loss logged to MLflow"
    first, last = losses[min(losses)], losses[max(losses)]
    assert last < first - 0.3, (first, last)


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_two_workers_train_to_succeeded(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    bucket: str,
    engine: str,
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    name = f"gpt-{engine}"
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(job(name, engine, bucket, s3, mlflow, max_steps=40))
    )
    status = wait_finished(cluster, loom_operator, ns, name, timeout=400)
    if status["phase"] != "Succeeded":
        logs = "\n".join(worker_logs(cluster, ns, f"{name}-worker-{i}")[-3000:] for i in range(2))
        raise AssertionError(f"{status}\n{logs}\n{loom_operator.log_tail()}")
    assert_trained(cluster, s3, mlflow, bucket, name, status, steps=40)
    assert status["restarts"] == 0 and status["failures"] == 0


def kill_container(uid: str) -> None:
    """SIGKILL the worker's main process (torchrun) and everything it started: a crashed container."""
    pid = int((AGENT_STATE_DIR / "pods" / uid / "c" / "trainer" / "pid").read_text())
    main = psutil.Process(pid)
    children = main.children(recursive=True)
    main.kill()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def test_killed_worker_recovers_from_checkpoint_and_succeeds(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    bucket: str,
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    name = "gpt-chaos"
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(job(name, "fsdp", bucket, s3, mlflow, max_steps=80))
    )
    wait_until(
        lambda: [s for s in committed_steps(s3, bucket, name) if s >= 20],
        timeout=300,
        what="a checkpoint at step >= 20",
        interval=1,
    )
    pod = json.loads(cluster.kubectl("get", "pod", f"{name}-worker-1", "-n", ns, "-o", "json").stdout)
    before_kill = worker_logs(cluster, ns, f"{name}-worker-0")
    kill_container(pod["metadata"]["uid"])

    # The restart is visible while the new gang forms and restores (phase Restarting until the trainer runs
    # steps again), and no status shows a step below its checkpoint (a fresh trainer reports step 0 first).
    seen: list[dict[str, Any]] = []

    def recovered() -> bool:
        seen.append(status_of(cluster, ns, name))
        phases = [s.get("phase") for s in seen]
        return "Restarting" in phases and phases[-1] in ("Running", "Succeeded", "Failed")

    wait_until(recovered, timeout=300, what=f"TrainingJob {name} to restart and run again", interval=0.5)
    for sample in seen:
        step, checkpoint = (sample.get("progress") or {}).get("step"), (sample.get("checkpoint") or {}).get("step")
        assert step is None or checkpoint is None or step >= checkpoint, sample

    status = wait_finished(cluster, loom_operator, ns, name, timeout=400)
    if status["phase"] != "Succeeded":
        raise AssertionError(
            f"{status}\n{worker_logs(cluster, ns, f'{name}-worker-0')[-3000:]}\n{loom_operator.log_tail()}"
        )
    assert status["restarts"] == 1, status
    assert status["failures"] == 1, status
    assert_trained(cluster, s3, mlflow, bucket, name, status, steps=80)

    # The new gang resumed from a committed checkpoint and the loss curve continues from it.
    after = worker_logs(cluster, ns, f"{name}-worker-0")
    resumed = events(after, "resume")
    assert resumed, after[-3000:]
    resume_step = resumed[0]["step"]
    assert resume_step >= 20
    # The MLflow run records it too (`make demo` marks it on the loss picture from this tag).
    run_id = status["mlflow"]["runId"]
    run = httpx.get(
        f"{mlflow.url}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10, trust_env=False
    ).json()["run"]
    tagged = {tag["key"]: tag["value"] for tag in run["data"].get("tags", []) if tag["key"].startswith("loom.resume.")}
    # Keyed by gang attempt 1 (the gang after the kill) and torchrun's first start inside it.
    assert tagged == {"loom.resume.1.0": f"{resumed[0]['uri']}@{resume_step}"}, run["data"].get("tags")
    before = {e["step"]: e["loss"] for e in events(before_kill, "step")}
    after_steps = {e["step"]: e["loss"] for e in events(after, "step")}
    assert min(after_steps) == resume_step + 1
    overlap = [s for s in after_steps if s in before]
    for step in overlap:  # the same data and state: identical losses where both runs trained a step
        assert after_steps[step] == pytest.approx(before[step], abs=1e-3), step


def test_suspend_checkpoints_and_resume_continues_from_it(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    bucket: str,
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    name = "gpt-pause"
    manifest = job(name, "fsdp", bucket, s3, mlflow, max_steps=100)
    manifest["spec"]["checkpoint"]["everySteps"] = 1000  # only the suspend's final checkpoint can exist
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(manifest))
    wait_until(
        lambda: (status_of(cluster, ns, name).get("progress") or {}).get("step", 0) >= 10,
        timeout=300,
        what="training past step 10 (progress read from rank 0)",
        interval=1,
    )
    cluster.kubectl(
        "patch", "trainingjob", name, "-n", ns, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}'
    )
    wait_until(
        lambda: (
            status_of(cluster, ns, name).get("phase") == "Suspended"
            and not json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
        ),
        timeout=180,
        what="workers stopped on suspend",
        interval=1,
    )
    saved = committed_steps(s3, bucket, name)
    assert len(saved) == 1 and 10 <= saved[0] < 100, saved  # the final checkpoint written on SIGTERM

    cluster.kubectl(
        "patch", "trainingjob", name, "-n", ns, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}'
    )
    status = wait_finished(cluster, loom_operator, ns, name, timeout=400)
    assert status["phase"] == "Succeeded", f"{status}\n{loom_operator.log_tail()}"
    assert (status["restarts"], status["failures"], status["attempt"]) == (0, 0, 1)
    resumed = events(worker_logs(cluster, ns, f"{name}-worker-0"), "resume")
    assert resumed and resumed[0]["step"] == saved[0]


def test_permanent_user_error_fails_fast_without_retries(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    bucket: str,
) -> None:
    """A task that does not exist is a user error: the trainer exits with its permanent code, says so in the
    termination message, and the operator fails the job at once instead of spending the restart budget."""
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    manifest = job("typo", "fsdp", bucket, s3, mlflow, max_steps=10)
    manifest["spec"]["entrypoint"]["module"] = "loom.workloads.trainer.examples.no_such_module:task"
    manifest["spec"]["runPolicy"]["backoffLimit"] = 3
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(manifest))
    status = wait_finished(cluster, loom_operator, ns, "typo", timeout=300)
    assert status["phase"] == "Failed", status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PermanentError", failed
    assert "no_such_module" in failed["message"], failed
    assert status["restarts"] == 0, status
