"""Model-server benchmarks (loopback only, bounded loops, numbers printed, nothing asserted).

1. Overhead: a no-op model behind the full server (OIP decode, guard middleware, batcher, metrics,
   encode) against a bare uvicorn/Starlette app answering a fixed JSON body, both measured here and
   now; sequential requests over one keep-alive connection. Goal: server p50 under 2 ms.
2. Batching: the bundled character-level GPT generating from the same closed-loop load (C clients,
   each sending its next request when the last one returns) with maxBatchSize=1 and with batching.
   Goal: at least 4x the throughput at a p99 no worse than the unbatched server's.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_server.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from loom.devstack.servers import free_port
from loom.workloads.server import testing

BARE_APP = """
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
BODY = b'{"model_name":"noop","outputs":[{"name":"x","datatype":"FP32","shape":[4],"data":[1.0,2.0,3.0,4.0]}]}'
async def infer(request):
    await request.body()
    return Response(BODY, media_type="application/json")
app = Starlette(routes=[Route("/v2/models/noop/infer", infer, methods=["POST"]),
                        Route("/v2/health/ready", lambda r: Response(b"{}"), methods=["GET"])])
"""


@contextlib.contextmanager
def model_server(workdir: Path, name: str, **config: Any) -> Iterator[str]:
    path = workdir / f"{name}.json"
    path.write_text(json.dumps({"port": free_port(), "host": "127.0.0.1", "logLevel": "warning", **config}))
    with testing.model_server(path, workdir / f"{name}.log") as url:
        yield url


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sequential_latencies(url: str, path: str, body: dict[str, Any], count: int) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(count + 50):
            started = time.perf_counter()
            response = client.post(path, json=body)
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            if i >= 50:  # warm-up: connection, first batch, lazy imports
                latencies.append(elapsed)
    return latencies


def bench_overhead(workdir: Path, count: int) -> None:
    body = {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    (workdir / "bare_app.py").write_text(BARE_APP)
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "bare_app:app", "--port", str(port), "--log-level", "warning",
            "--no-access-log"]
    config = {"modelName": "noop", "handler": "noop", "storageUri": str(workdir),
              "batching": {"maxBatchSize": 1, "maxLatencyMs": 0}}
    # Alternate baseline and server twice and keep each one's better run: the machine is shared.
    bare_runs, served_runs = [], []
    for _ in range(2):
        with testing.running(argv, f"http://127.0.0.1:{port}", workdir / "bare.log", cwd=workdir) as url:
            bare_runs.append(sequential_latencies(url, "/v2/models/noop/infer", body, count))
        with model_server(workdir, "noop", **config) as url:
            served_runs.append(sequential_latencies(url, "/v2/models/noop/infer", body, count))
    bare = min(bare_runs, key=statistics.median)
    served = min(served_runs, key=statistics.median)
    bare_p50, served_p50 = statistics.median(bare), statistics.median(served)
    print(f"\n== overhead: noop model, {count} sequential requests over one keep-alive connection")
    print(f"bare starlette app   p50 {bare_p50 * 1e3:6.3f} ms   p99 {percentile(bare, 0.99) * 1e3:6.3f} ms")
    print(f"loom server (noop)   p50 {served_p50 * 1e3:6.3f} ms   p99 {percentile(served, 0.99) * 1e3:6.3f} ms")
    print(f"server p50 overhead over the bare app: {(served_p50 - bare_p50) * 1e3:.3f} ms "
          f"(x{served_p50 / bare_p50:.2f}); goal p50 < 2 ms: {'met' if served_p50 < 0.002 else 'NOT met'}")


async def closed_loop(url: str, body: dict[str, Any], clients: int, total: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    remaining = total
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                response = await client.post("/v2/models/chargpt/infer", json=body)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()

        async def scrape_gpu_metrics() -> None:
            # Mid-run, while the GPU is busy: NVML utilization is a recent-window average.
            await asyncio.sleep(1.0)
            text = (await client.get("/metrics")).text
            gpu_lines.extend(line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_"))

        gpu_lines: list[str] = []
        started = time.perf_counter()
        scraper = asyncio.ensure_future(scrape_gpu_metrics())
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - started
        await scraper
        if gpu_lines:
            print("GPU metrics scraped from the server's /metrics during the run:")
            print("\n".join(f"  {line}" for line in gpu_lines))
        return total / elapsed, latencies


def bench_batching(
    workdir: Path, device: str, clients: int, total: int, tokens: int, size: str, latency_ms: float
) -> None:
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    torch.manual_seed(0)
    dims = {"small": {}, "large": {"n_layer": 6, "n_head": 8, "n_embd": 512, "block_size": 128}}[size]
    model = chargpt.GPT(chargpt.GPTConfig(**dims))
    folder = save_for_serving(model, workdir / "chargpt")
    body = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Tom Sawyer said "]}],
        "parameters": {"max_tokens": tokens, "temperature": 0.8, "top_k": 20},
    }
    results = {}
    for label, batch in (("maxBatchSize=1", 1), (f"maxBatchSize={clients}", clients)):
        config = {"modelName": "chargpt", "handler": "chargpt", "storageUri": str(folder), "device": device,
                  "batching": {"maxBatchSize": batch, "maxLatencyMs": latency_ms, "maxQueue": 4 * clients}}
        with model_server(workdir, f"chargpt-{batch}", **config) as url:
            asyncio.run(closed_loop(url, body, clients, 2 * clients))  # warm-up
            throughput, latencies = asyncio.run(closed_loop(url, body, clients, total))
            histogram = httpx.get(f"{url}/metrics").text
        sizes = [line for line in histogram.splitlines() if line.startswith("loom_server_batch_size_sum")
                 or line.startswith("loom_server_batch_size_count")]
        mean_batch = float(sizes[1].split()[-1]) / max(1.0, float(sizes[0].split()[-1])) if len(sizes) == 2 else 0
        results[label] = (throughput, statistics.median(latencies), percentile(latencies, 0.99), mean_batch)
    print(f"\n== batching: chargpt ({size}, {model.num_parameters() / 1e6:.2f} M params) on {device}, "
          f"{clients} closed-loop clients, {total} requests of {tokens} generated tokens each")
    for label, (throughput, p50, p99, mean_batch) in results.items():
        print(f"{label:16s} {throughput:8.1f} req/s  {throughput * tokens:9.0f} tok/s  p50 {p50 * 1e3:8.1f} ms"
              f"  p99 {p99 * 1e3:8.1f} ms  mean batch {mean_batch:5.1f}")
    (one, _, one_p99, _), (many, _, many_p99, _) = results.values()
    print(f"throughput ratio batched/unbatched: x{many / one:.2f} (goal >= 4x); "
          f"p99 batched {many_p99 * 1e3:.1f} ms vs unbatched {one_p99 * 1e3:.1f} ms "
          f"({'within' if many_p99 <= one_p99 else 'over'} the unbatched p99 budget)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="small", choices=["small", "large"])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--skip-overhead", action="store_true")
    # A generation batch takes tens of ms: waiting up to 20 ms for companions costs little and lets
    # the clients' next requests (which arrive spread out) join the same batch.
    parser.add_argument("--max-latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-bench-server-") as tmp:
        workdir = Path(tmp)
        if not args.skip_overhead:
            bench_overhead(workdir, 200 if args.quick else 1000)
        total = 4 * args.clients if args.quick else 16 * args.clients
        bench_batching(workdir, args.device, args.clients, total, 16, args.size, args.max_latency_ms)


if __name__ == "__main__":
    main()
