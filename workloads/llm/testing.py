"""Run the vllm runtime for real (the front's own command, the real engine) in tests and benchmarks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from loom.workloads.server.config import AuthConfig
from loom.workloads.server.testing import running

from .config import EngineOptions, LlmLimits, LlmServerConfig
from .hf_model import LlamaShape, write_llama_folder

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


@contextlib.contextmanager
def tiny_llm_replicas(
    folder: Path,
    count: int,
    key: str,
    free_port: Callable[[], int],
    *,
    model_name: str = "tiny-llama",
    max_model_len: int = 512,
    max_num_seqs: int = 2,
    max_tokens_limit: int = 64,
    extra_args: Sequence[str] = (),
) -> Iterator[list[str]]:
    """`count` replicas of the vllm runtime (front + real engine each) on one tiny random-weight Llama written under
    ``folder/model``, started side by side (each engine's start is mostly imports), API key ``key`` on every front;
    yields their URLs. ``free_port``: the caller's (the local stack's devstack.servers.free_port; workloads may not
    import the local stack). ``max_num_seqs`` small makes a few long requests queue the others (the load a picker
    reads)."""
    model_dir = folder / "model"
    if not model_dir.exists():
        write_llama_folder(model_dir, LlamaShape(max_positions=max_model_len))
    python = vllm_python(Path(__file__).resolve().parents[2])

    def config() -> LlmServerConfig:
        return LlmServerConfig(
            model_name=model_name, model_dir=str(model_dir), host="127.0.0.1", port=free_port(),
            engine_port=free_port(), engine_python=python, log_level="warning",
            engine=EngineOptions(max_model_len=max_model_len, dtype="float32", enforce_eager=True,
                                 kv_cache_memory_bytes=64 << 20, max_num_seqs=max_num_seqs,
                                 extra_args=list(extra_args)),
            auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"), limits=LlmLimits(max_tokens_limit=max_tokens_limit),
        )  # fmt: skip

    with contextlib.ExitStack() as stack:
        dirs = [folder / f"r{i}" for i in range(count)]
        for d in dirs:
            d.mkdir(exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            urls = list(
                pool.map(lambda d: stack.enter_context(llm_server(config(), d, env={"LOOM_TEST_KEYS": key})), dirs)
            )
        yield urls


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
