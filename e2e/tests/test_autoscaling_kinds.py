"""The builtin autoscaler on another kind, end to end: an InferenceGraph whose router autoscales on a `prometheus`
query. A test-driven exporter pod publishes the load series, the real Prometheus scrapes it through Kubernetes
service discovery, the operator (a subprocess) reads it, and writes the router's replicas through the
InferenceGraph's scale subresource (spec.router.replicas); the reconcile pass rolls the router Deployment to it and
the node agent runs the new router. The graph's one InferenceService runs on a kwok node (nothing to load: the
graph only needs it to exist to render its router)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.autoscaling import autoscaled, condition, scale_writes
from loom.e2e.exporter import Exporter
from loom.e2e.pytest_operator import OperatorProcess, operator_namespace_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT_S = 120.0
GRAPH = "routed"




def service_on_kwok(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "s3://unused/m"},
            "handler": "noop",
            "replicas": 1,
            "nodeSelector": {"type": "kwok"},
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


def graph(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceGraph",
        "metadata": {"name": GRAPH},
        "spec": {
            "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "echo"}]}},
            "router": {
                "autoscaling": {
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "metric": "prometheus",
                    "query": f'sum(loom_e2e_router_load{{namespace="{namespace}"}})',
                    "target": 60,
                    "scaleDown": {"stabilizationWindowSeconds": 0},
                }
            },
        },
    }


def get_graph(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "inferencegraph", GRAPH, "-n", namespace, "-o", "json").stdout))


def test_an_inferencegraph_router_scales_up_on_a_prometheus_query(
    cluster: Cluster, autoscaling_operator: OperatorProcess
) -> None:
    op = autoscaling_operator
    started = time.monotonic()
    with operator_namespace_for(cluster, op) as namespace:
        exporter = Exporter(cluster, namespace, name="router-load", initial="loom_e2e_router_load 30\n")
        exporter.start()
        docs = [service_on_kwok("echo"), graph(namespace)]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(docs))

        def state(check: Any, what: str) -> dict[str, Any]:
            def probe() -> dict[str, Any] | None:
                current = get_graph(cluster, namespace)
                return current if check(current) else None

            try:
                return dict(wait_until(probe, timeout=TIMEOUT_S, what=what, interval=0.5))
            except TimeoutError as error:
                current = get_graph(cluster, namespace)
                raise AssertionError(
                    f"{error}\nspec.router={current['spec'].get('router')} "
                    f"status={json.dumps(current.get('status'), indent=1)}\n{op.log_tail(80)}"
                ) from None

        # Below the target (30 against 60 per replica): read, one router replica.
        # The value and the condition can land in two writes (a reconcile pass that read the graph before the
        # autoscaler's write replaces the conditions; the autoscaler's next round puts its condition back).
        calm = state(
            lambda o: autoscaled(o).get("metricValue") == 30
            and condition(o, "MetricsAvailable").get("status") == "True",
            "30 seen on one router replica, MetricsAvailable",
        )
        assert calm["spec"]["router"]["replicas"] == 1 and autoscaled(calm)["desiredReplicas"] == 1
        assert f"app.kubernetes.io/instance={GRAPH}" in calm["status"]["selector"]  # the scale subresource's

        # Above it: ceil(120 / 60) = 2, written through the InferenceGraph's scale subresource.
        exporter.publish_text("loom_e2e_router_load 120\n")
        up = state(
            lambda o: o["spec"]["router"].get("replicas") == 2 and autoscaled(o).get("metricValue") == 120,
            "router scaled up to 2 and reported",
        )
        assert autoscaled(up)["lastScaleReason"] == "ScaledUp"
        (write,) = [w for w in scale_writes(op.log, namespace, GRAPH) if w.reason == "ScaledUp"]
        assert (write.before, write.after) == (1, 2)
        scale = json.loads(
            cluster.kubectl("get", "--raw", f"/apis/loom.dev/v1alpha1/namespaces/{namespace}/inferencegraphs/"
                            f"{GRAPH}/scale").stdout
        )  # fmt: skip
        assert scale["spec"]["replicas"] == 2
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={GRAPH},reason=ScaledUp",
            "-o", "json",
        ).stdout  # fmt: skip
        assert any(e["message"].startswith("replicas 1 -> 2: ") for e in json.loads(events)["items"])
        # The reconcile pass follows: two router replicas, both Ready on the node agent.
        rolled = state(lambda o: (o.get("status") or {}).get("readyReplicas") == 2, "two router replicas ready")
        deployment = json.loads(
            cluster.kubectl("get", "deployment", f"{GRAPH}-router", "-n", namespace, "-o", "json").stdout
        )
        assert deployment["spec"]["replicas"] == 2 and rolled["status"]["replicas"] == 2
    print(f"[autoscaling kinds] wall time {time.monotonic() - started:.1f}s", file=sys.__stderr__)
