"""LoRA adapters in a running vLLM service on the local stack, with no restart.

examples/inferenceservice-llama-vllm-adapters.yaml is applied unchanged, after what it names is put in the stack's S3
(minio.storage.svc): a tiny Hugging Face Llama of the llama example's shape where that example's TrainingJob exports;
its two adapters are the ones `loom dev up` seeds for it. The service becomes Ready with both adapters Loaded in
status; the official `openai` client lists the base and both adapters and is answered by each. Then, while clients keep
sending requests to the base model and an adapter, a third adapter is added to spec.adapters: the operator rewrites the
adapter list in the ConfigMap, the node agent updates the mounted file in place (as the kubelet does), the front loads
it through vLLM's runtime LoRA API, status shows it Loaded on the replica and it answers. Then one is removed: it
leaves /v1/models and its name is a 404. No request of the load failed, and the pod is the same pod (uid) that never
restarted (restart count 0).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from loom.devstack import backing
from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.e2e.pytest_operator import OperatorProcess, operator_namespace_for
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import write_lora_adapter

# The engine's start alone takes minutes on a busy 2-core machine (6 min seen), after the stack's backing services.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inferenceservice-llama-vllm-adapters.yaml"
API_KEY = f"key-{uuid.uuid4().hex}"


def upload(services: backing.BackingServices, folder: Path, uri: str) -> None:
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    client = services.s3_client()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


@pytest.fixture
def namespace(cluster: Cluster, loom_operator: OperatorProcess) -> Iterator[str]:
    with operator_namespace_for(cluster, loom_operator) as ns:
        yield ns


def test_adapters_are_added_and_removed_in_a_running_replica_with_no_restart(
    cluster: Cluster, loom_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    services = backing.ensure(cluster, progress=lambda line: print(f"[adapters] {line}"))
    (doc,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    name, spec = doc["metadata"]["name"], doc["spec"]
    # The base model where the example names it (the llama example's TrainingJob would write it there). Its two
    # adapters are the ones `loom dev up` seeds (numpy-made, devstack/backing.py), as a new user's stack has them; the
    # third one, added later, is made with peft itself.
    base = write_llama_folder(tmp_path / "base", LlamaShape(max_positions=256))
    upload(services, base, spec["model"]["uri"])
    adapter_uris = {a["name"]: a["uri"] for a in spec["adapters"]}
    bard_uri = adapter_uris["poet"].rsplit("/", 1)[0] + "/bard"
    upload(services, write_lora_adapter(base, tmp_path / "bard", seed=3), bard_uri)
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(backing.credentials_secret(ns)))
    secret = spec["auth"]["apiKeysSecretRef"]
    keys = f"--from-literal={secret['key']}={API_KEY}"
    cluster.kubectl("create", "secret", "generic", secret["name"], "-n", ns, keys)
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))

    def get() -> dict[str, Any]:
        return dict(json.loads(cluster.kubectl("get", "inferenceservice", name, "-n", ns, "-o", "json").stdout))

    def adapters_loaded(names: set[str]) -> dict[str, Any] | None:
        obj = get()
        conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions", [])}
        states = {a["name"]: a for a in (obj.get("status") or {}).get("adapters") or []}
        failed = {n: a.get("reason") for n, a in states.items() if a["state"] == "Failed"}
        if failed:  # no need to wait out the timeout: say why at once
            raise AssertionError(f"adapters failed: {failed}\n{server_log()}")
        if conds.get("Ready") != "True" or set(states) != names:
            return None
        return obj if all(a["state"] == "Loaded" for a in states.values()) else None

    def server_log() -> str:
        return cluster.kubectl("logs", "-n", ns, "-l", f"app.kubernetes.io/instance={name}", "-c", "server",
                               "--tail=60", check=False).stdout

    def wait_loaded(names: set[str], what: str) -> dict[str, Any]:
        try:
            return dict(wait_until(lambda: adapters_loaded(names), timeout=900, what=what, interval=2))
        except TimeoutError as error:
            pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
            raise AssertionError(f"{error}\n{json.dumps(get().get('status'), indent=1)}\n{pods}\n{server_log()}\n"
                                 f"{loom_operator.log_tail()}") from None

    ready = wait_loaded({"pirate", "poet"}, "the example Ready with both adapters Loaded")
    (replica,) = ready["status"]["adapters"][0]["replicas"]
    (pod,) = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}",
                                        "-o", "json").stdout)["items"]
    assert replica["pod"] == pod["metadata"]["name"] and replica["state"] == "Loaded"

    llm = openai.OpenAI(base_url=f"http://{service_address(name, ns, AGENT_STATE_DIR)}:80/v1", api_key=API_KEY,
                        max_retries=0, timeout=120)
    assert [m.id for m in llm.models.list().data] == [name, "pirate", "poet"]
    for model in (name, "pirate", "poet"):
        answer = llm.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tom painted"}],
                                             max_tokens=6, temperature=0)
        assert answer.model == model and answer.choices[0].message.content is not None

    # A load on the base model and an adapter that stays, through an addition and a removal.
    stop, failures, answered = threading.Event(), [], [0]

    def client_loop(model: str) -> None:
        while not stop.is_set():
            try:
                llm.completions.create(model=model, prompt="The fence", max_tokens=8, temperature=0)
                answered[0] += 1
            except openai.OpenAIError as exc:
                failures.append(f"{model}: {exc}")

    clients = [threading.Thread(target=client_loop, args=(m,), daemon=True) for m in (name, "pirate")]
    for thread in clients:
        thread.start()
    try:
        added = [*spec["adapters"], {"name": "bard", "uri": bard_uri}]
        cluster.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"adapters": added}}))
        wait_loaded({"pirate", "poet", "bard"}, "the added adapter Loaded")
        assert [m.id for m in llm.models.list().data] == [name, "pirate", "poet", "bard"]
        assert llm.completions.create(model="bard", prompt="Tom", max_tokens=4).model == "bard"

        kept = [a for a in added if a["name"] != "poet"]
        cluster.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"adapters": kept}}))
        wait_loaded({"pirate", "bard"}, "status without the removed adapter")
        wait_until(lambda: [m.id for m in llm.models.list().data] == [name, "pirate", "bard"], timeout=60,
                   what="the removed adapter gone from /v1/models", interval=0.5)
        with pytest.raises(openai.NotFoundError):
            llm.completions.create(model="poet", prompt="Tom", max_tokens=4)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    assert not failures, failures[:5]
    assert answered[0] > 0
    (after,) = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}",
                                          "-o", "json").stdout)["items"]
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert [c["restartCount"] for c in after["status"]["containerStatuses"]] == [0]
