"""spec.routing.prefixMatch events against the real API server (kwok: no pod runs; the engines' events and the
picker following them are proven with real vLLM engines in tests/integration/test_picker_precise_vllm.py): the
replicas' engines get the KV-events flag on a wildcard host and the events port, the picker's config follows them
on that port with no tokenizer folder (it reads the tokenizer from a replica), and the API server's CEL rules refuse
events without prefix-cache."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def service(name: str, **routing: Any) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"runtime": "vllm", "model": {"uri": f"s3://models/{name}/v1"}, "replicas": 2, "routing": routing},
    }


def picker_config(deployment: dict[str, Any]) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return dict(json.loads(next(e["value"] for e in container["env"] if e["name"] == "LOOM_PICKER_CONFIG")))


def test_events_render_the_engine_flag_and_the_pickers_subscription(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns, name = operator_namespace, f"precise-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(service(name, prefixMatch="events")))
    picker = wait_until(lambda: get(cluster, ns, "deployment", f"{name}-picker"), timeout=120,
                        what="the picker's Deployment")
    assert picker_config(picker)["kvEvents"] == {"port": 5557, "topic": "", "tokenizerDir": None,
                                                 "silenceSeconds": 5.0, "relearnSeconds": 30.0}
    server = wait_until(lambda: get(cluster, ns, "deployment", name), timeout=120, what="the replicas' Deployment")
    container = server["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in container["ports"]
    llm = json.loads(get(cluster, ns, "configmap", f"{name}-config")["data"]["llm.json"])
    assert llm["engine"]["kvEventsPort"] == 5557  # the front passes vLLM --kv-events-config on tcp://*:5557

    # The estimate again: the flag, the port and the subscription go.
    cluster.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"routing": {"prefixMatch": "estimate"}}}))
    wait_until(lambda: picker_config(get(cluster, ns, "deployment", f"{name}-picker")).get("kvEvents") is None,
               timeout=120, what="the picker without kvEvents")
    wait_until(lambda: "kvEventsPort" not in json.loads(
        get(cluster, ns, "configmap", f"{name}-config")["data"]["llm.json"])["engine"], timeout=120,
        what="llm.json without kvEventsPort")


def test_events_without_prefix_cache_are_refused_at_admission(cluster: Cluster, operator_namespace: str) -> None:
    name = f"precise-{uuid.uuid4().hex[:6]}"
    refused = cluster.kubectl("apply", "-n", operator_namespace, "-f", "-", check=False,
                              stdin=json.dumps(service(name, prefixMatch="events", policy="round-robin")))
    assert refused.returncode != 0
    assert "prefixMatch: events needs policy: prefix-cache" in refused.stderr
