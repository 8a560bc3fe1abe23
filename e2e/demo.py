"""`make demo`: Loom's main job, end to end, on the local real stack.

1. bring up the local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok GPU nodes and
   the node agent that really runs pods), a real S3 server and a real MLflow server;
2. start the Loom operator;
3. apply a 2-worker FSDP TrainingJob of the bundled character-level GPT: it trains, checkpoints to S3 and
   logs to MLflow, and the demo kills one worker halfway to show recovery from the last checkpoint;
4. apply an InferenceService serving that TrainingJob's checkpoint and generate text through its Service.

Everything it starts it stops again, except the control plane when it was already running before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import psutil
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster, StackConfig, current, up
from loom.devstack.cluster import down as stack_down
from loom.devstack.cluster.paths import AGENT_STATE_DIR, STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint, mlflow_server, s3_server
from loom.e2e.pytest_operator import apply_crds, operator_process

NAMESPACE = "demo-loom"
JOB = "chargpt"
SERVICE = "chargpt"
MAX_STEPS = 120
T = TypeVar("T")


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def kubectl_json(cluster: Cluster, *args: str) -> dict[str, Any] | None:
    result = cluster.kubectl(*args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def apply(cluster: Cluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump(obj))


def training_job(s3: S3Endpoint, mlflow_url: str, bucket: str) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {
                "module": "loom.workloads.trainer.examples.chargpt:task",
                "args": ["nLayer=2", "nEmbd=64", "nHead=4", "blockSize=32"],
            },
            "maxSteps": MAX_STEPS,
            "env": [
                {"name": "OMP_NUM_THREADS", "value": "1"},
                {"name": "AWS_DEFAULT_REGION", "value": s3.region},
            ],
            "workers": {"replicas": 2, "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}},
            "checkpoint": {
                "uri": f"s3://{bucket}/{JOB}",
                "endpoint": s3.url,
                "secretRef": {"name": "s3-credentials"},
                "everySteps": 20,
                "keepLast": 2,
            },
            "tracking": {"mlflow": {"trackingUri": mlflow_url, "experiment": "loom-demo"}},
            "runPolicy": {"backoffLimit": 2},
        },
    }


def inference_service(s3: S3Endpoint) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": SERVICE},
        "spec": {
            "model": {
                "fromTrainingJob": {"name": JOB, "checkpoint": "latest"},
                "endpoint": s3.url,
                "secretRef": {"name": "s3-credentials"},
            },
            "handler": "chargpt",
            "replicas": 1,
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}, {"name": "OMP_NUM_THREADS", "value": "1"}],
            "batching": {"maxBatchSize": 8, "maxLatencyMs": 5},
        },
    }


def kill_one_worker(cluster: Cluster) -> str | None:
    """SIGKILL the trainer processes of worker 1, as a crashed process or OOM kill would."""
    pod = kubectl_json(cluster, "get", "pod", f"{JOB}-worker-1", "-n", NAMESPACE)
    if not pod:
        return None
    pid_file = AGENT_STATE_DIR / "pods" / pod["metadata"]["uid"] / "c" / "trainer" / "pid"
    try:
        main = psutil.Process(int(pid_file.read_text()))
        victims = [main, *main.children(recursive=True)]
    except (OSError, ValueError, psutil.Error):
        return None
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    return str(pod["metadata"]["name"])


def train(cluster: Cluster, s3: S3Endpoint, mlflow_url: str, bucket: str) -> dict[str, Any]:
    apply(cluster, training_job(s3, mlflow_url, bucket))
    say(f"applied TrainingJob {JOB}: 2 FSDP workers, {MAX_STEPS} steps, checkpoints every 20 steps to s3://{bucket}")
    killed = False
    last_line = ""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        obj = kubectl_json(cluster, "get", "trainingjob", JOB, "-n", NAMESPACE) or {}
        status = obj.get("status") or {}
        progress = status.get("progress") or {}
        checkpoint = (status.get("checkpoint") or {}).get("step")
        line = (
            f"phase={status.get('phase')} step={progress.get('step')}/{progress.get('totalSteps')} "
            f"loss={progress.get('loss')} checkpoint@{checkpoint} restarts={status.get('restarts', 0)}"
        )
        if line != last_line:
            say(line)
            last_line = line
        if status.get("phase") in ("Succeeded", "Failed"):
            return status
        if not killed and checkpoint and checkpoint >= 40:
            victim = kill_one_worker(cluster)
            if victim:
                killed = True
                say(f"killed the trainer in {victim} (SIGKILL): Loom must resume from the step-{checkpoint} checkpoint")
        time.sleep(2)
    raise TimeoutError("the TrainingJob did not finish in 15 minutes")


def serve(cluster: Cluster, s3: S3Endpoint) -> str:
    apply(cluster, inference_service(s3))
    say(f"applied InferenceService {SERVICE} serving TrainingJob {JOB}'s latest checkpoint")

    def ready() -> dict[str, Any] | None:
        obj = kubectl_json(cluster, "get", "inferenceservice", SERVICE, "-n", NAMESPACE) or {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        return obj if conds.get("Ready", {}).get("status") == "True" else None

    obj = wait_for(ready, 600, "the InferenceService to be Ready", interval=2)
    say(f"InferenceService Ready: url={obj['status'].get('url')} version={obj['status'].get('modelVersion')}")

    def address_published() -> str | None:
        # The node agent publishes a Service's local proxy address a moment after its endpoints turn ready.
        try:
            return service_address(SERVICE, NAMESPACE, AGENT_STATE_DIR)
        except (KeyError, OSError, ValueError):
            return None

    address = wait_for(address_published, 60, "the Service's address on the node agent", interval=0.5)
    response = httpx.post(
        f"http://{address}:80/v2/models/{SERVICE}/generate",
        json={"text_input": "The ", "parameters": {"max_tokens": 80, "temperature": 0.8}},
        timeout=60,
    )
    response.raise_for_status()
    return str(response.json().get("text_output", ""))


def clear_leftovers(cluster: Cluster) -> None:
    """Remove what an interrupted earlier run left. Kopf does not serve a namespace that is already
    Terminating, so Loom's finalizers on leftover objects there are dropped by hand (their children go
    with their ownerReferences)."""
    if kubectl_json(cluster, "get", "namespace", NAMESPACE) is None:
        return
    say(f"removing namespace {NAMESPACE} left by an earlier run")
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)

    def gone() -> bool | None:
        if kubectl_json(cluster, "get", "namespace", NAMESPACE) is None:
            return True
        for name in cluster.kubectl("get", "loom", "-n", NAMESPACE, "-o", "name", check=False).stdout.split():
            cluster.kubectl(
                "patch", name, "-n", NAMESPACE, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )
        return None

    wait_for(gone, 180, "the old namespace", interval=2)


@contextlib.contextmanager
def control_plane() -> Iterator[Cluster]:
    started_here = current() is None
    cluster = up(StackConfig(), say)
    try:
        yield cluster
    finally:
        if started_here and not os.environ.get("LOOM_DEMO_KEEP"):
            say("stopping the control plane it started (LOOM_DEMO_KEEP=1 keeps it)")
            stack_down(say)


def main() -> int:
    # SIGTERM (timeout, CI, a closed terminal) unwinds like Ctrl-C, so every server the demo started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = STATE_DIR / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    say("starting the local real stack (the first run builds Kubernetes from its Go modules: many minutes)")
    with control_plane() as cluster, s3_server(workdir / "s3") as s3, mlflow_server(workdir / "mlflow", s3) as mlflow:
        say(f"S3 server at {s3.url}, MLflow server at {mlflow.url}")
        apply_crds(cluster)
        # The operator runs before the namespace is (re)made: Loom objects left by an earlier run carry its
        # finalizer, so only a running operator lets their namespace go.
        with operator_process(cluster, workdir / "operator.log", prefix="demo") as op:
            clear_leftovers(cluster)
            cluster.kubectl("create", "namespace", NAMESPACE)
            wait_for(
                lambda: kubectl_json(cluster, "get", "serviceaccount", "default", "-n", NAMESPACE),
                60,
                "the default ServiceAccount",
            )
            cluster.kubectl(
                "create", "secret", "generic", "s3-credentials", "-n", NAMESPACE,
                f"--from-literal=AWS_ACCESS_KEY_ID={s3.access_key}",
                f"--from-literal=AWS_SECRET_ACCESS_KEY={s3.secret_key}",
            )  # fmt: skip
            bucket = "loom-demo"
            s3.client().create_bucket(Bucket=bucket)
            say(f"loom operator running (log: {op.log})")
            status = train(cluster, s3, mlflow.url, bucket)
            if status.get("phase") != "Succeeded":
                say(f"TrainingJob ended {status.get('phase')}: {json.dumps(status.get('conditions'), indent=1)}")
                return 1
            checkpoint = (status.get("checkpoint") or {}).get("latest")
            run_url = (status.get("mlflow") or {}).get("url")
            say(f"TrainingJob Succeeded after {status.get('restarts', 0)} restart(s); checkpoint {checkpoint}")
            say(f"MLflow run: {run_url}")
            text = serve(cluster, s3)
            say(f"generated through the Service: {text!r}")
            print(cluster.kubectl("get", "loom", "-n", NAMESPACE).stdout, flush=True)
            say("cleaning up: deleting the demo namespace while the operator still runs")
            cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=180s", check=False)
    say("done: trained with a worker killed mid-run, resumed from S3, tracked in MLflow, served, generated text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
