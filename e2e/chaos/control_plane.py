"""Faults in the stack itself: the API server and etcd restarted in the middle of reconciling (the node agent
restarted while it serves is loom.e2e.chaos.serving's).

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
from loom.operator.api.common import GROUP, VERSION

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


def api_server_and_etcd_restart(cluster: Any, workdir: Path) -> Figures:
    """Objects being reconciled while the API server, then etcd, restart; then new objects (and a pod on the node
    agent) created: everything becomes Ready with the same operator and node agent processes."""
    from loom.e2e.pytest_operator import apply_crds, operator_process

    apply_crds(cluster)
    prefix = f"lp{uuid.uuid4().hex[:6]}"
    problems: list[str] = []
    figures: Figures = {}
    agent = procs.running("node-agent")
    with operator_process(cluster, workdir / "operator-control-plane.log", prefix=prefix) as op, \
            cluster.api_client() as api, _namespace(cluster, prefix) as ns:
        for obj in (training_job("before-tj"), inference_service("before-is")):
            _create(api, ns, obj)
        figures["apiserver_restart_s"] = restart(cluster, "kube-apiserver")
        figures["etcd_restart_s"] = restart(cluster, "etcd")
        # A fresh client: the one from before may hold connections the restart closed.
        with cluster.api_client() as fresh:
            for obj in (training_job("after-tj"), inference_service("after-is")):
                _create(fresh, ns, obj)
            client.CoreV1Api(fresh).create_namespaced_pod(ns, _sleeper("after-pod"))
            started = time.monotonic()
            names = ["before-tj", "before-is", "after-tj", "after-is"]
            try:
                wait_until(lambda: all(_ready(o) for o in loom_objects(fresh, ns).values())
                           and len(loom_objects(fresh, ns)) == 4, timeout=120, what="every object Ready", interval=1)
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
        if op.process.poll() is not None:
            problems.append(f"the operator exited ({op.process.returncode}): {op.log_tail(20)}")
    after = procs.running("node-agent")
    if agent is not None and (after is None or after.pid != agent.pid):
        problems.append("the node agent did not survive the restarts")
    figures["problems"] = problems
    return figures


@scenario("api-server-etcd-restart", "API server then etcd restarted while reconciling (serial)")
def api_server_etcd_restart(run: Run) -> Figures:
    return api_server_and_etcd_restart(run.cluster, run.workdir)
