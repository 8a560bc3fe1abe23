"""Serving under change and under node faults, measured with an open-loop load (load.py) through the Service address
the node agent proxies, against real model server processes (the noop handler: it echoes, so the rate is the
server's and the proxy's, not a model's).

- `serving_load`: a steady load held through a rollout (new model), a canary (20 %) and its promotion, and a
  scale-down: no request may fail; p50/p99 latency before and during the changes are reported.
- `agent_restart`: the node agent restarted (SIGHUP: it leaves its pods running and re-adopts them) while serving;
  the pods must survive (same pods, no container restart) and serving must resume; the failed requests (the agent's
  Service proxies are down between the two agents) are counted. At report scale the agent also stays away past the
  node lease, so the node goes NotReady, and serving must come back once the agent returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster import procs
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME

from .load import OpenLoopLoad
from .registry import Figures, Run, scenario


def _kubectl_patch(cluster: Any, ns: str, name: str, patch: Any, kind: str = "merge") -> None:
    cluster.kubectl("patch", "inferenceservice", name, "-n", ns, "--type", kind, "-p", json.dumps(patch))


def _pods(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/name=inferenceservice,app.kubernetes.io/instance={name}"
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout
    return list(json.loads(out)["items"])


def _deploy(cluster: Any, op: Any, ns: str, s3: Any, bucket: str, name: str, replicas: int) -> list[str]:
    """The s3 secret, three model versions and the service at v1, rolled out; returns the versions' URIs."""
    from loom.e2e.pytest_services import apply_s3_secret
    from loom.e2e.tests.test_inferenceservice import manifest, upload_placeholder_model, wait_rolled_out

    apply_s3_secret(cluster, ns, s3)
    uris = [upload_placeholder_model(s3, bucket, f"{name}/v{i}") for i in (1, 2, 3)]
    body = manifest(name, uris[0], s3, handler="noop", replicas=replicas)
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
    wait_rolled_out(cluster, op, ns, name)
    return uris


def serving_load(cluster: Any, op: Any, ns: str, s3: Any, bucket: str, rps: float, before_s: float,
                 max_s: float, replicas: int = 3) -> Figures:  # fmt: skip
    from loom.e2e.tests.test_inferenceservice import service_url, wait_rolled_out

    name = "steady"
    uris = _deploy(cluster, op, ns, s3, bucket, name, replicas)
    problems: list[str] = []
    steps: dict[str, float] = {}
    with OpenLoopLoad(service_url(ns, name), name, rps=rps, max_s=max_s) as load:
        wait_until(lambda: load.served() >= rps * before_s, timeout=before_s * 4 + 10, what="the load before")

        def step(phase: str, change: Any, reason: str = "RolledOut") -> None:
            load.phase = phase
            started = time.monotonic()
            change()
            wait_rolled_out(cluster, op, ns, name, reason=reason)
            steps[f"{phase}_s"] = round(time.monotonic() - started, 1)

        step("rollout", lambda: _kubectl_patch(cluster, ns, name, {"spec": {"model": {"uri": uris[1]}}}))
        step("canary", lambda: _kubectl_patch(
            cluster, ns, name, {"spec": {"model": {"uri": uris[2]}, "rollout": {"canaryPercent": 20}}}),
            reason="CanaryRolledOut")  # fmt: skip
        step("promotion", lambda: _kubectl_patch(
            cluster, ns, name, [{"op": "remove", "path": "/spec/rollout/canaryPercent"}], kind="json"))
        load.phase = "scale-down"
        started = time.monotonic()
        _kubectl_patch(cluster, ns, name, {"spec": {"replicas": 1}})
        # Done when one pod is left: the removed ones have drained and exited while the load ran.
        wait_until(lambda: len(_pods(cluster, ns, name)) == 1, timeout=120, what="one replica left", interval=0.5)
        steps["scale-down_s"] = round(time.monotonic() - started, 1)
        load.phase = "after"
        served = load.served()
        wait_until(lambda: load.served() >= served + rps, timeout=30, what="the load after")
    figures: Figures = load.figures()
    figures["steps"] = steps
    # The phases during the changes, together.
    figures["latency_during_ms"] = [
        v for phase in ("rollout", "canary", "promotion", "scale-down") for v in figures.get(f"latency_{phase}_ms", [])
    ]
    if figures["failed_requests"]:
        problems.append(f"{figures['failed_requests']} failed requests: {figures['failure_examples']}")
    if "v3" not in figures["versions"]:
        problems.append(f"the promoted version never answered: {figures['versions']}")
    figures["problems"] = problems
    return figures


def _node_ready(cluster: Any) -> str:
    node = json.loads(cluster.kubectl("get", "node", AGENT_NODE_NAME, "-o", "json").stdout)
    return next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "Unknown")


def _containers(pods: list[dict[str, Any]]) -> dict[str, int]:
    """uid -> restarts of each pod."""
    return {p["metadata"]["uid"]: sum(s.get("restartCount", 0) for s in p["status"].get("containerStatuses") or [])
            for p in pods}  # fmt: skip


def agent_restart(cluster: Any, op: Any, ns: str, s3: Any, bucket: str, rps: float, down_s: float,
                  not_ready: bool = False) -> Figures:  # fmt: skip
    """Restart the node agent (away for `down_s`; with `not_ready` until the node is NotReady) under load."""
    from loom.e2e.tests.test_inferenceservice import service_url

    name = "steady"
    _deploy(cluster, op, ns, s3, bucket, name, replicas=2)
    pods_before = _containers(_pods(cluster, ns, name))
    problems: list[str] = []
    figures: Figures = {}
    with OpenLoopLoad(service_url(ns, name), name, rps=rps, max_s=300 if not_ready else 60) as load:
        wait_until(lambda: load.served() >= rps * 2, timeout=30, what="the load before")
        record = procs.running("node-agent")
        if record is None:
            raise RuntimeError("the stack's node agent is not running")
        load.phase = "agent-away"
        away = time.monotonic()
        os.kill(record.pid, signal.SIGHUP)  # exits, leaving its pods running
        wait_until(lambda: procs.running("node-agent") is None, timeout=30, what="the agent to exit")
        if not_ready:
            wait_until(lambda: _node_ready(cluster) != "True", timeout=180, what="the node NotReady", interval=2)
            figures["node_not_ready_after_s"] = round(time.monotonic() - away, 1)
        else:
            time.sleep(down_s)
        procs.start("node-agent", record.argv, env={**os.environ, "PYTHONSAFEPATH": "1"})
        load.phase = "agent-back"
        back = time.monotonic()
        # Serving is back when a full second of requests has succeeded in a row.
        def resumed() -> bool:
            recent = [o for o in load.snapshot() if o.started >= back]
            tail = recent[-int(rps):]
            return len(tail) >= int(rps) and all(o.error is None for o in tail)

        wait_until(resumed, timeout=120, what="serving after the agent returned", interval=0.5)
        figures["serving_again_after_s"] = round(time.monotonic() - back, 1)
        if not_ready:
            wait_until(lambda: _node_ready(cluster) == "True", timeout=60, what="the node Ready again", interval=1)
        load.phase = "after"
        served = load.served()
        wait_until(lambda: load.served() >= served + rps * 3, timeout=30, what="the load after")
    figures = {**load.figures(), **figures}
    outcomes = load.snapshot()
    figures["failed_while_away"] = sum(1 for o in outcomes if o.error and o.phase == "agent-away")
    figures["failed_after_back"] = sum(1 for o in outcomes if o.error and o.phase == "agent-back")
    after = [o for o in outcomes if o.phase == "after"]
    if any(o.error for o in after):
        problems.append(f"failures once serving resumed: {[o.error for o in after if o.error][:3]}")
    pods_after = _containers(_pods(cluster, ns, name))
    figures["pods_replaced"] = len(set(pods_before) - set(pods_after))
    figures["container_restarts"] = sum(pods_after.get(uid, 0) for uid in pods_before)
    if not not_ready and (figures["pods_replaced"] or figures["container_restarts"]):
        problems.append(f"the agent restart did not leave the pods running: {pods_before} -> {pods_after}")
    figures["problems"] = problems
    return figures


@contextlib.contextmanager
def _setting(run: Run) -> Iterator[tuple[Any, str, Any, str]]:
    """An operator, a namespace it watches, an S3 server and a bucket of the scenario's own."""
    from loom.devstack.servers import s3_server
    from loom.e2e.pytest_operator import apply_crds, operator_namespace_for, operator_process

    apply_crds(run.cluster)
    with (s3_server(Path(run.workdir) / "s3") as s3,
          operator_process(run.cluster, Path(run.workdir) / "operator-serving.log") as op,
          operator_namespace_for(run.cluster, op) as ns):  # fmt: skip
        s3.client().create_bucket(Bucket="serving")
        yield op, ns, s3, "serving"


@scenario("serving-load", "steady load through a rollout, a canary promotion and a scale-down: no failed request")
def serving_load_scenario(run: Run) -> Figures:
    rate, before, bound = (50.0, 3.0, 150.0) if run.scale == "test" else (200.0, 10.0, 300.0)
    with _setting(run) as (op, ns, s3, bucket):
        return serving_load(run.cluster, op, ns, s3, bucket, rps=rate, before_s=before, max_s=bound)


@scenario("agent-restart", "the node agent restarted, and away until the node is NotReady, while serving (serial)")
def agent_restart_scenario(run: Run) -> Figures:
    with _setting(run) as (op, ns, s3, bucket):
        figures = agent_restart(run.cluster, op, ns, s3, bucket, rps=50.0, down_s=1.0)
        if run.scale == "report":
            away = agent_restart(run.cluster, op, ns, s3, bucket, rps=50.0, down_s=0, not_ready=True)
            figures.update({f"not_ready_{k}": v for k, v in away.items() if k != "problems"})
            figures["problems"] = figures["problems"] + away["problems"]
        return figures
