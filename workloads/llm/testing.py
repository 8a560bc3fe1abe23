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
    engine is ready; stop it (and so the engine) afterwards. The front's log is ``folder/llm.log``."""
    path = folder / "llm.json"
    path.write_text(config.to_json())
    argv = [sys.executable, "-m", "loom.workloads.llm", "--config", str(path), "--drain-seconds=0"]
    with running(argv, f"http://127.0.0.1:{config.port}", folder / "llm.log", env, timeout_s=START_TIMEOUT_S) as url:
        yield url
