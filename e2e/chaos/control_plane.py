"""Faults in the stack itself: the API server and etcd restarted in the middle of reconciling and of a real
training run (the node agent restarted while it serves is loom.e2e.chaos.serving's).

These restart the SHARED stack's components: the tests that run them are marked `serial` (never beside another
test session). Components are restarted with the exact command line they run with (their process record), so the
stack is the same afterwards: same ports, same certificates, same data directory.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from loom.devstack.cluster import procs
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint, s3_server
from loom.operator.core.model import GROUP, VERSION

from .churn import PLURALS, inference_service, loom_objects, training_job
from .registry import Figures, Run, scenario


def _api_ready(cluster: Any) -> bool:
    return bool(cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0)


def restart(cluster: Any, name: str) -> float:
    """Stop a stack component (SIGTERM, then SIGKILL) and start it again with its recorded command line; returns the
    seconds until the API server answers /readyz again."""
    record = procs.running(name)
    if record is None:
        raise RuntimeError(f"{name} is not running")
    started = time.monotonic()
    procs.stop(name)
    procs.start(name, record.argv, env={**os.environ, "PYTHONSAFEPATH": "1"})
    wait_until(lambda: _api_ready(cluster), timeout=120, what=f"the API server ready after restarting {name}",
               interval=0.3)
    return round(time.monotonic() - started, 2)


@contextlib.contextmanager
def _namespace(cluster: Any, prefix: str) -> Iterator[str]:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_until(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
               timeout=30, what=f"default ServiceAccount in {name}")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "loom", "--all", "-n", name, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _ready(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
    return bool(ready.get("status") == "True" and status.get("observedGeneration") == obj["metadata"]["generation"])


def _sleeper(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"]}]}}  # fmt: skip


def _create(api: client.ApiClient, ns: str, obj: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURALS[obj["kind"]], obj)


# The real training run: long enough (tens of seconds) to span both restarts, one small CPU worker.
TRAINED = "trained"
TRAINED_STEPS = 200
TINY_MODEL = ["nLayer=2", "nEmbd=64", "nHead=4", "blockSize=32"]


def _trained_job(bucket: str, s3: S3Endpoint) -> dict[str, Any]:
    env = [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "DS_ACCELERATOR", "value": "cpu"},
           {"name": "AWS_DEFAULT_REGION", "value": s3.region}]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": TRAINED},
            "spec": {"engine": "fsdp", "maxSteps": TRAINED_STEPS, "env": env,
                     "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task", "args": TINY_MODEL},
                     "workers": {"replicas": 1, "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}},
                     "checkpoint": {"uri": f"s3://{bucket}/{TRAINED}", "endpoint": s3.url, "everySteps": 100,
                                    "keepLast": 1, "secretRef": {"name": "s3-credentials"}}}}  # fmt: skip


def _job_status(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    job = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, ns, "trainingjobs", name)
    return dict(job.get("status") or {})


def _start_training(cluster: Any, api: client.ApiClient, ns: str, s3: S3Endpoint, figures: Figures) -> str | None:
    """Create the real TrainingJob and wait until it trains (rank 0 reports steps); the worker pod's uid, or None
    (with a problem in figures) when it never started."""
    from loom.e2e.pytest_services import apply_s3_secret

    bucket = f"restart-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    apply_s3_secret(cluster, ns, s3)
    _create(api, ns, _trained_job(bucket, s3))
    started = time.monotonic()

    def training() -> bool:
        status = _job_status(api, ns, TRAINED)
        return status.get("phase") == "Running" and ((status.get("progress") or {}).get("step") or 0) > 0

    try:
        wait_until(training, timeout=300, what="the TrainingJob training (steps reported)", interval=0.5)
    except TimeoutError:
        figures["problems"].append(f"the TrainingJob never trained: {_job_status(api, ns, TRAINED)}")
        return None
    figures["training_started_s"] = round(time.monotonic() - started, 1)
    figures["training_step_at_restart"] = (_job_status(api, ns, TRAINED).get("progress") or {}).get("step")
    pod = client.CoreV1Api(api).read_namespaced_pod(f"{TRAINED}-worker-0", ns)
    return str(pod.metadata.uid)


def _training_finished(api: client.ApiClient, ns: str, worker_uid: str, figures: Figures) -> None:
    """The job trained on through the restarts: Succeeded at its last step, by the same worker, no restart."""
    started = time.monotonic()

    def finished() -> dict[str, Any] | None:
        status = _job_status(api, ns, TRAINED)
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    try:
        status = wait_until(finished, timeout=300, what="the TrainingJob finished", interval=1)
    except TimeoutError:
        figures["problems"].append(f"the TrainingJob never finished: {_job_status(api, ns, TRAINED)}")
        return
    figures["training_finished_after_restarts_s"] = round(time.monotonic() - started, 1)
    progress, checkpoint = status.get("progress") or {}, status.get("checkpoint") or {}
    if status.get("phase") != "Succeeded" or progress.get("step") != TRAINED_STEPS:
        figures["problems"].append(f"the TrainingJob did not train to its end: {status}")
    if (status.get("restarts"), status.get("failures")) != (0, 0):
        figures["problems"].append(f"the TrainingJob restarted across the control-plane restarts: {status}")
    if checkpoint.get("step") != TRAINED_STEPS:
        figures["problems"].append(f"no final checkpoint in status: {checkpoint}")
    pods = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"loom.dev/trainingjob={TRAINED}").items
    if [p.metadata.uid for p in pods] not in ([worker_uid], []):
        figures["problems"].append(f"the worker was replaced: {[p.metadata.name for p in pods]}")


def api_server_and_etcd_restart(cluster: Any, workdir: Path, s3: S3Endpoint | None = None) -> Figures:
    """Objects being reconciled, and (given an S3 server) a real TrainingJob training, while the API server, then
    etcd, restart; then new objects (and a pod on the node agent) created: everything becomes Ready with the same
    operator and node agent processes, and the training job trains on to Succeeded without a restart."""
    from loom.e2e.pytest_operator import apply_crds, operator_process

    apply_crds(cluster)
    prefix = f"lp{uuid.uuid4().hex[:6]}"
    problems: list[str] = []
    figures: Figures = {"problems": problems}
    agent = procs.running("node-agent")
    worker_uid: str | None = None
    with operator_process(cluster, workdir / "operator-control-plane.log", prefix=prefix) as op, \
            cluster.api_client() as api, _namespace(cluster, prefix) as ns:
        if s3 is not None:
            worker_uid = _start_training(cluster, api, ns, s3, figures)
        for obj in (training_job("before-tj"), inference_service("before-is")):
            _create(api, ns, obj)
        figures["apiserver_restart_s"] = restart(cluster, "kube-apiserver")
        figures["etcd_restart_s"] = restart(cluster, "etcd")
        # A fresh client: the one from before may hold connections the restart closed.
        with cluster.api_client() as fresh:
            if worker_uid is not None:
                figures["training_step_after_restarts"] = (_job_status(fresh, ns, TRAINED).get("progress") or {}
                                                           ).get("step")
            for obj in (training_job("after-tj"), inference_service("after-is")):
                _create(fresh, ns, obj)
            client.CoreV1Api(fresh).create_namespaced_pod(ns, _sleeper("after-pod"))
            started = time.monotonic()
            names = ["before-tj", "before-is", "after-tj", "after-is"]

            def reconciled() -> dict[str, dict[str, Any]]:
                return {n: o for n, o in loom_objects(fresh, ns).items() if n in names}

            try:
                wait_until(lambda: all(_ready(o) for o in reconciled().values()) and len(reconciled()) == 4,
                           timeout=120, what="every object Ready", interval=1)
            except TimeoutError:
                objs = loom_objects(fresh, ns)
                problems += [f"{n} not Ready: {(objs.get(n) or {}).get('status')}" for n in names
                             if not _ready(objs.get(n) or {"metadata": {"generation": -1}})]
            figures["ready_after_restarts_s"] = round(time.monotonic() - started, 1)
            try:
                wait_until(lambda: client.CoreV1Api(fresh).read_namespaced_pod("after-pod", ns).status.phase
                           == "Running", timeout=60, what="a pod on the node agent Running", interval=0.5)
            except TimeoutError:
                problems.append("a pod created after the restarts never ran on the node agent")
            if worker_uid is not None:
                _training_finished(fresh, ns, worker_uid, figures)
        if op.process.poll() is not None:
            problems.append(f"the operator exited ({op.process.returncode}): {op.log_tail(20)}")
    after = procs.running("node-agent")
    if agent is not None and (after is None or after.pid != agent.pid):
        problems.append("the node agent did not survive the restarts")
    return figures


@scenario("api-server-etcd-restart", "API server then etcd restarted while reconciling and training (serial)")
def api_server_etcd_restart(run: Run) -> Figures:
    with s3_server(run.workdir / "s3") as s3:
        return api_server_and_etcd_restart(run.cluster, run.workdir, s3)
