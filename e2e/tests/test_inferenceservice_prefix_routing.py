"""Prefix-cache routing on the local stack: a vllm InferenceService of three replicas (a tiny random-weight Llama
from S3, the real vLLM engine behind Loom's front in each) with `routing.policy: prefix-cache`. The operator runs
its endpoint picker (`<name>-picker`) and points the Service at it once Ready; clients send requests sharing a
handful of long system prompts through the Service while the service is scaled from three replicas to two: no
request fails (the replica leaving gets nothing new; what it had finishes), and the picker routed by prefix (its
own metrics, read from its pod).

Cheap on purpose: the smallest Llama the CPU kernels take, maxModelLen 512, system prompts of a few hundred
tokens, four generated tokens per request.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.picker.testing import samples, total

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

NAME = "prefix-llama"
API_KEY = f"key-{uuid.uuid4().hex}"
SYSTEMS = [f"Desk {i}. You answer questions for the {topic} desk of a small shop; be short, name the form to use, "
           f"and never promise a date. " * 4
           for i, topic in enumerate(("billing", "shipping", "returns"))]
STREAMS = 4


def service(bucket: str, s3: S3Endpoint) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": f"s3://{bucket}/{NAME}", "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}},
            "replicas": 3,
            "routing": {"policy": "prefix-cache"},
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "auth": {"apiKeysSecretRef": {"name": "llm-keys", "key": "keys"}},
            "vllm": {"maxModelLen": 512, "dtype": "float32", "enforceEager": True,
                     "kvCacheMemoryBytes": 32 << 20, "maxNumSeqs": 4, "maxTokens": 16},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}],
        },
    }


def get(cluster: Cluster, ns: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def pods(cluster: Cluster, ns: str, component: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l",
                          f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component={component}",
                          "-o", "json").stdout
    return list(json.loads(out)["items"])


def test_prefix_routing_over_three_replicas_loses_nothing_on_scale_down(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint, bucket: str,
    tmp_path: Path,
) -> None:
    ns = operator_namespace
    folder = write_llama_folder(tmp_path / NAME, LlamaShape(max_positions=512))
    client = s3.client()
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), bucket, f"{NAME}/{path.name}")
    apply_s3_secret(cluster, ns, s3)
    cluster.kubectl("create", "secret", "generic", "llm-keys", "-n", ns, f"--from-literal=keys={API_KEY}")
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service(bucket, s3)))

    def routed_by_picker() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", NAME)
        svc = get(cluster, ns, "service", NAME)
        ready = (obj.get("status") or {}).get("readyReplicas") == 3
        picker = (svc.get("spec") or {}).get("selector", {}).get("app.kubernetes.io/component") == "picker"
        return obj if ready and picker else None

    try:
        wait_until(routed_by_picker, timeout=900, what="3 Ready replicas behind the picker", interval=3)
    except TimeoutError as error:
        listing = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        status = json.dumps(get(cluster, ns, "inferenceservice", NAME).get("status"), indent=1)
        raise AssertionError(f"{error}\n{status}\n{listing}\n{loom_operator.log_tail()}") from None
    [picker_pod] = pods(cluster, ns, "picker")
    assert len(pods(cluster, ns, "server")) == 3  # the picker is not counted as a replica
    admin = f"http://{picker_pod['status']['podIP']}:9090"

    url = f"http://{service_address(NAME, ns, AGENT_STATE_DIR)}:80/v1/chat/completions"
    headers = {"authorization": f"Bearer {API_KEY}"}
    stop = threading.Event()
    answers: list[int] = []
    failures: list[str] = []

    def load(worker: int) -> None:
        with httpx.Client(timeout=120, trust_env=False) as http:
            i = 0
            while not stop.is_set():
                system = SYSTEMS[(worker + i) % len(SYSTEMS)]
                body = {"model": NAME, "max_tokens": 4, "temperature": 0, "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": f"Question {worker}-{i}?"}]}
                try:
                    response = http.post(url, json=body, headers=headers)
                    answers.append(response.status_code)
                    if response.status_code != 200:
                        failures.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                i += 1

    workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(STREAMS)]
    for thread in workers:
        thread.start()
    try:
        wait_until(lambda: len(answers) >= 20 or None, timeout=300, what="20 answers under load", interval=1)
        cluster.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":2}}')

        def two_left() -> bool | None:
            servers = pods(cluster, ns, "server")
            return (len(servers) == 2 and get(cluster, ns, "inferenceservice", NAME)["status"].get(
                "readyReplicas") == 2) or None

        wait_until(two_left, timeout=300, what="the third replica gone", interval=1)
        settled = len(answers)
        wait_until(lambda: len(answers) >= settled + 10 or None, timeout=300, what="10 answers after", interval=1)
    finally:
        stop.set()
        for thread in workers:
            thread.join(timeout=120)
    assert not failures, failures[:5]
    assert len(answers) >= 30 and set(answers) == {200}

    found = samples(admin)
    decisions = {reason: total(found, "loom_picker_decisions_total", reason=reason)
                 for reason in ("prefix", "load", "load_override", "all_overloaded")}
    # Three prompts: after each one's first request the picker knows where its blocks are.
    assert decisions["prefix"] >= 0.5 * len(answers), decisions
    ratios = [v for (n, _), v in found.items() if n == "loom_picker_replica_prefix_cache_hit_ratio"]
    assert ratios and max(ratios) > 0.3, ratios  # the engines' own counters: their caches were hit
    assert total(found, "loom_picker_decision_seconds_count") >= len(answers)
