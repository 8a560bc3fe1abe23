"""InferenceGraph router benchmark: overhead per hop (loopback only, bounded loops, printed, not asserted).

A no-op model server (the real ``loom.workloads.server`` process) and two routers (the real
``loom.workloads.router`` processes), all on 127.0.0.1:

- 1 hop: a Sequence of one step to the model, against calling the model directly;
- 2 hops: a Sequence of two steps (the second gets the first's ``$response``, so the router chains
  outputs into inputs), against the client calling the model twice in a row itself.

Sequential requests over one keep-alive connection each. Direct and routed runs alternate in
rounds, so load from elsewhere on the machine falls on both alike. Overhead per hop =
(routed - direct) / hops, at p50 and p99. The router's own time (its request histogram minus its
step histogram, i.e. everything but the upstream calls) comes from its /metrics, as a mean; its CPU
time per request (from /proc, Linux) does not depend on how loaded the machine is, unlike latency.
Goal: p50 overhead under 1 ms per hop (the 0.5-1 ms of a Knative/Envoy hop).

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_router.py [--quick] [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loom.devstack.servers import free_port
from loom.workloads.server import testing

GOAL_S = 0.001
WARMUP = 50
BODY = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def model_server(workdir: Path) -> Iterator[str]:
    path = workdir / "noop.json"
    path.write_text(json.dumps({
        "port": free_port(), "host": "127.0.0.1", "logLevel": "warning", "modelName": "noop",
        "handler": "noop", "storageUri": str(workdir), "batching": {"maxBatchSize": 1, "maxLatencyMs": 0},
    }))
    with testing.model_server(path, workdir / "noop.log") as url:
        yield url


@contextlib.contextmanager
def router(workdir: Path, graph: str, steps: list[dict[str, Any]], model_url: str) -> Iterator[str]:
    port = free_port()
    path = workdir / f"{graph}.json"
    path.write_text(json.dumps({
        "graphName": graph, "host": "127.0.0.1", "port": port, "logLevel": "warning",
        "nodes": {"root": {"routerType": "Sequence", "steps": steps}},
        "services": {"noop": {"url": model_url, "modelName": "noop"}},
    }))
    argv = [sys.executable, "-m", "loom.workloads.router", "--config", str(path)]
    with testing.running(argv, f"http://127.0.0.1:{port}", workdir / f"{graph}.log") as url:
        yield url


def timed(client: httpx.Client, path: str, calls: int, count: int) -> list[float]:
    """``count`` timings of ``calls`` back-to-back POSTs each (the client's own chain for calls > 1)."""
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        for _ in range(calls):
            client.post(path, json=BODY).raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


def cpu_seconds(marker: str) -> float:
    """CPU time (user + system) so far of this process's child whose command line contains ``marker``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # Fields after the command name: state ppid ... utime(14) stime(15), counted from 1.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and marker in (stat.parent / "cmdline").read_text():
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def router_times(text_before: str, text_after: str, graph: str) -> tuple[float, float]:
    """From two /metrics scrapes: mean seconds per request the router spent in its handler, and of
    that, in its upstream calls (the step histogram: the pooled client plus the model's answer)."""

    def sums(text: str) -> dict[str, float]:
        totals = dict.fromkeys(("request_sum", "request_count", "step_sum"), 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model", sample.labels.get("graph")) != graph:
                    continue
                if sample.name == "loom_server_request_duration_seconds_sum":
                    totals["request_sum"] += sample.value
                elif sample.name == "loom_server_request_duration_seconds_count":
                    totals["request_count"] += sample.value
                elif sample.name == "loom_router_step_duration_seconds_sum":
                    totals["step_sum"] += sample.value
        return totals

    before, after = sums(text_before), sums(text_after)
    requests = max(1.0, after["request_count"] - before["request_count"])
    return ((after["request_sum"] - before["request_sum"]) / requests,
            (after["step_sum"] - before["step_sum"]) / requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, help="measured requests per variant (default 1000, quick 200)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating direct/routed rounds")
    args = parser.parse_args()
    count = args.requests or (200 if args.quick else 1000)
    per_round = max(1, count // args.rounds)
    graphs = {
        1: ("hop1", [{"serviceName": "noop", "data": "$request", "dependency": "Hard"}]),
        2: ("hop2", [{"name": "first", "serviceName": "noop", "data": "$request", "dependency": "Hard"},
                     {"name": "second", "serviceName": "noop", "data": "$response", "dependency": "Hard"}]),
    }
    with tempfile.TemporaryDirectory(prefix="loom-bench-router-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        model_url = stack.enter_context(model_server(workdir))
        urls = {hops: stack.enter_context(router(workdir, graph, steps, model_url))
                for hops, (graph, steps) in graphs.items()}
        direct = stack.enter_context(httpx.Client(base_url=model_url, timeout=30))
        routed = {hops: stack.enter_context(httpx.Client(base_url=url, timeout=30)) for hops, url in urls.items()}
        # Warm-up: connections, lazy imports, the model server's first batch, the routers' pools.
        timed(direct, "/v2/models/noop/infer", 1, WARMUP)
        for hops, (graph, _) in graphs.items():
            timed(routed[hops], f"/v2/models/{graph}/infer", 1, WARMUP)
        before = {hops: routed[hops].get("/metrics").text for hops in graphs}
        results: dict[tuple[str, int], list[float]] = {}
        cpu = dict.fromkeys(graphs, 0.0)
        model_cpu = 0.0
        for _ in range(args.rounds):
            for hops, (graph, _) in graphs.items():
                started = cpu_seconds("noop.json")
                results.setdefault(("direct", hops), []).extend(
                    timed(direct, "/v2/models/noop/infer", hops, per_round))
                model_cpu += cpu_seconds("noop.json") - started
                started = cpu_seconds(f"{graph}.json")
                results.setdefault(("router", hops), []).extend(
                    timed(routed[hops], f"/v2/models/{graph}/infer", 1, per_round))
                cpu[hops] += cpu_seconds(f"{graph}.json") - started
        inside = {hops: router_times(before[hops], routed[hops].get("/metrics").text, graph)
                  for hops, (graph, _) in graphs.items()}

    print(f"\n== router overhead: noop model, {per_round * args.rounds} sequential requests per variant "
          f"({args.rounds} alternating rounds), one keep-alive connection each, 127.0.0.1")
    print(f"{'variant':34s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for hops in graphs:
        d, r = results[("direct", hops)], results[("router", hops)]
        print(f"{f'direct, {hops} call(s) in a row':34s} {statistics.median(d) * 1e3:8.3f} "
              f"{percentile(d, 0.99) * 1e3:8.3f}")
        print(f"{f'router, Sequence of {hops} step(s)':34s} {statistics.median(r) * 1e3:8.3f} "
              f"{percentile(r, 0.99) * 1e3:8.3f}")
    print(f"\n{'overhead per hop':16s} {'p50 ms':>7s} {'p99 ms':>7s}   goal p50 < 1 ms"
          f"   router CPU ms/hop   router handler, mean ms/hop: own, upstream calls (direct mean)")
    for hops in graphs:
        d, r = results[("direct", hops)], results[("router", hops)]
        p50 = (statistics.median(r) - statistics.median(d)) / hops
        p99 = (percentile(r, 0.99) - percentile(d, 0.99)) / hops
        handler, upstream = inside[hops]
        print(f"{f'{hops} hop(s)':16s} {p50 * 1e3:7.3f} {p99 * 1e3:7.3f}   {'met' if p50 < GOAL_S else 'NOT met':15s}"
              f"   {cpu[hops] / (per_round * args.rounds) / hops * 1e3:16.3f}"
              f"   {(handler - upstream) / hops * 1e3:.3f}, {upstream / hops * 1e3:.3f} "
              f"({statistics.fmean(d) / hops * 1e3:.3f})")
    direct_calls = per_round * args.rounds * sum(graphs)
    print(f"for scale: the model server's CPU per direct call (HTTP in and out, noop model): "
          f"{model_cpu / direct_calls * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
