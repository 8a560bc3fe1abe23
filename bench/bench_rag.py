"""Retrieval-augmented generation through an InferenceGraph: the latency the graph adds over calling the LLM directly
(loopback only, bounded loops, printed, not asserted).

The real router (``python -m loom.workloads.router``, its own process) in front of stand-ins served by uvicorn in
another process: an OpenAI chat service that answers at once (``FakeChat``: the LLM's own time is not what is
measured, and is the same whichever way it is called), and an embedding service plus Feast's ``POST /search``
(precomputed answers of the real shapes and sizes: a 32-dimension embedding, and 4 documents of 60 words in Feast's
column-wise search form). Three variants, sequential requests over one keep-alive connection each, alternating in
rounds so that load from elsewhere falls on all alike:

- direct: the client calls the chat service;
- graph: a one-step openai-chat graph (the router's hop alone);
- rag graph: the same step with ``retrieve`` (embed the question, search, build the prompt, then the chat call).

Added latency = variant - direct, at p50 and p99. What the retrieval itself costs in the router (its
``loom_router_retrieval_duration_seconds`` mean: two loopback calls and the parsing) is read from its /metrics. With a
real embedding model and store, their own time adds to this (bench the store with its own bench).

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_rag.py [--quick] [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
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

WARMUP = 30
QUESTION = [{"role": "user", "content": "How does the router stream an answer through the graph?"}]
TOPICS = ("router", "training", "features", "serving", "autoscaling", "storage")


def corpus() -> dict[str, tuple[str, str]]:
    words = ["graph", "step", "router", "stream", "answer", "model", "feature", "store", "vector", "search",
             "prompt", "question", "token", "replica"]
    return {
        f"doc{i:03d}#0": (" ".join(words[(i * 7 + j) % len(words)] for j in range(60)), TOPICS[i % len(TOPICS)])
        for i in range(48)
    }


def canned_store() -> Any:
    """The embedding service and the store answering precomputed bodies of the real sizes (a 32-dimension
    embedding; 4 of the corpus' documents, column-wise as Feast sends them), so that what is timed is the router's
    two calls and its work on them, not a stand-in's arithmetic."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from loom.workloads.router.testing import bag_of_words

    embedding = json.dumps({"object": "list", "model": "toy", "data": [
        {"object": "embedding", "index": 0, "embedding": bag_of_words(QUESTION[0]["content"])}]}).encode()
    rows = sorted(corpus().items())[:4]
    columns = {"text": [r[1][0] for r in rows], "topic": [r[1][1] for r in rows],
               "distance": [0.1 * (i + 1) for i in range(4)], "doc_id": [r[0] for r in rows]}
    search = json.dumps({"metadata": {"feature_names": list(columns)},
                         "results": [{"values": v} for v in columns.values()]}).encode()

    def answer(body: bytes) -> Any:
        async def handler(request: Request) -> Response:
            await request.body()
            return Response(body, media_type="application/json")

        return handler

    return Starlette(routes=[Route("/v1/embeddings", answer(embedding), methods=["POST"]),
                             Route("/search", answer(search), methods=["POST"])])


def serve_fakes() -> None:
    """The stand-ins, in this (child) process until killed."""
    import threading

    from loom.workloads.router.testing import FakeChat, serving

    with serving(FakeChat("answer:").app()) as chat, serving(canned_store()) as store:
        print(json.dumps({"chat": chat, "store": store}), flush=True)
        threading.Event().wait()


@contextlib.contextmanager
def fakes() -> Iterator[dict[str, str]]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-fakes"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield dict(json.loads(process.stdout.readline()))
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def router(workdir: Path, graph: str, step: dict[str, Any], urls: dict[str, str]) -> Iterator[str]:
    port = free_port()
    path = workdir / f"{graph}.json"
    from loom.workloads.router.testing import FakeVectorStore

    path.write_text(json.dumps({
        "graphName": graph, "host": "127.0.0.1", "port": port, "logLevel": "warning",
        "nodes": {"root": {"routerType": "Sequence", "steps": [step]}},
        "services": {"llm": {"url": urls["chat"], "modelName": "llm"}},
        "stores": {"docs": FakeVectorStore({}).store(urls["store"])},
    }))
    argv = [sys.executable, "-m", "loom.workloads.router", "--config", str(path)]
    with testing.running(argv, f"http://127.0.0.1:{port}", workdir / f"{graph}.log") as url:
        yield url


def timed(client: httpx.Client, model: str, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        client.post("/v1/chat/completions", json={"model": model, "messages": QUESTION}).raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def retrieval_mean(text: str) -> float:
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "loom_router_retrieval_duration_seconds_sum":
                total += sample.value
            elif sample.name == "loom_router_retrieval_duration_seconds_count":
                count += sample.value
    return total / max(count, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, help="measured requests per variant (default 600, quick 120)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fakes:
        serve_fakes()
        return
    count = args.requests or (120 if args.quick else 600)
    per_round = max(1, count // args.rounds)
    chat_step = {"name": "answer", "serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard"}
    rag_step = {**chat_step, "retrieve": {"featureView": "docs", "topK": 4, "promptBudgetChars": 4000}}
    with tempfile.TemporaryDirectory(prefix="loom-bench-rag-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        urls = stack.enter_context(fakes())
        graphs = {"graph": stack.enter_context(router(workdir, "plain", chat_step, urls)),
                  "rag graph": stack.enter_context(router(workdir, "rag", rag_step, urls))}
        clients = {"direct": (stack.enter_context(httpx.Client(base_url=urls["chat"], timeout=30)), "llm"),
                   "graph": (stack.enter_context(httpx.Client(base_url=graphs["graph"], timeout=30)), "plain"),
                   "rag graph": (stack.enter_context(httpx.Client(base_url=graphs["rag graph"], timeout=30)), "rag")}
        for client, model in clients.values():
            timed(client, model, WARMUP)
        results: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(args.rounds):
            for name, (client, model) in clients.items():
                results[name].extend(timed(client, model, per_round))
        retrieval = retrieval_mean(clients["rag graph"][0].get("/metrics").text)

    direct = results["direct"]
    print(f"\n== RAG graph latency: {per_round * args.rounds} sequential chat requests per variant "
          f"({args.rounds} alternating rounds), instant stand-ins, topK 4, 127.0.0.1")
    print(f"{'variant':12s} {'p50 ms':>8s} {'p99 ms':>8s} {'added p50':>10s} {'added p99':>10s}")
    for name, values in results.items():
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        added = (p50 - statistics.median(direct), p99 - percentile(direct, 0.99))
        print(f"{name:12s} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {added[0] * 1e3:10.3f} {added[1] * 1e3:10.3f}")
    print(f"retrieval step inside the router (embed + search + parse), mean: {retrieval * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
