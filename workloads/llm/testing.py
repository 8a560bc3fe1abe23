"""Run the vllm runtime for real (the front's own command, the real engine) in tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from loom.workloads.server.testing import running

from .config import LlmServerConfig

# The environment the Makefile builds for the engine (make venv-vllm); LOOM_VLLM_PYTHON overrides it.
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
# The engine's start on a busy 2-core machine: imports alone take a minute or more per process, three processes.
START_TIMEOUT_S = 900.0


def vllm_python(repo: Path) -> str:
    """The interpreter that has vLLM; a clear error (not a skip) when it is missing."""
    python = os.environ.get("LOOM_VLLM_PYTHON") or str(repo / DEFAULT_VLLM_PYTHON)
    if not Path(python).exists():
        raise RuntimeError(f"no vLLM environment at {python}: run `make venv-vllm` (or set LOOM_VLLM_PYTHON)")
    return python


@contextlib.contextmanager
def llm_server(config: LlmServerConfig, folder: Path, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """Write ``config`` under ``folder``, start ``python -m loom.workloads.llm`` on it, yield its URL once the
    engine is ready; stop it (and so the engine) afterwards. The front's log is ``folder/llm.log``. The URL's host
    is ``config.host`` when that is one address (127.0.0.11, say), the loopback for a wildcard."""
    path = folder / "llm.json"
    path.write_text(config.to_json())
    argv = [sys.executable, "-m", "loom.workloads.llm", "--config", str(path), "--drain-seconds=0"]
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    with running(argv, f"http://{host}:{config.port}", folder / "llm.log", env, timeout_s=START_TIMEOUT_S) as url:
        yield url


def write_lora_adapter(base: Path, dest: Path, seed: int, scale: float = 0.3, rank: int = 8) -> Path:
    """A peft LoRA adapter (adapter_config.json, adapter_model.safetensors) for the Hugging Face Llama in ``base``,
    made with peft itself. Its A and B matrices are drawn at ``scale`` (peft starts B at zero, which would change
    nothing), so it changes what the model says for certain; ``seed`` makes two adapters differ. Needs peft (the
    ``train`` extra), which brings transformers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    tuned = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, scale)
    tuned.save_pretrained(str(dest))
    return dest
