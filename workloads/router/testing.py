"""Test and benchmark helpers: a scripted Caller (services as async functions of the request
document) and ASGI apps served by a real uvicorn on 127.0.0.1 in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from .config import RouterConfig
from .payload import Payload
from .upstream import Stream, UpstreamFailure

Handler = Callable[[Any], Awaitable[Any]]


@dataclass
class Call:
    service: str
    endpoint: str
    payload: Payload
    headers: dict[str, str]

    @property
    def doc(self) -> Any:
        return self.payload.doc()


@dataclass
class FakeCaller:
    """Each service is a handler: doc in, doc out (or an UpstreamFailure raised, or bytes answered as is)."""

    handlers: dict[str, Handler] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    async def call(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Payload:
        self.calls.append(Call(service, endpoint, payload, dict(headers)))
        answer = await self.handlers[service](payload.doc())
        if isinstance(answer, Payload):
            return answer
        return Payload(json.dumps(answer).encode(), origin="response")

    async def stream(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Stream:
        self.calls.append(Call(service, endpoint, payload, dict(headers)))
        answer = await self.handlers[service](payload.doc())
        text = answer["text_output"]

        async def rest() -> AsyncIterator[bytes]:
            for char in text[1:]:
                yield f"data: {json.dumps({'text_output': char})}\n\n".encode()

        return Stream(f"data: {json.dumps({'text_output': text[:1]})}\n\n".encode(), rest())

    def services(self) -> list[str]:
        return [c.service for c in self.calls]


def scale(factor: float, output: str = "y") -> Handler:
    """An OIP model: every input's data times ``factor`` as one output."""

    async def handler(doc: Any) -> Any:
        first = doc["inputs"][0]
        return {
            "model_name": f"x{factor}",
            "outputs": [{"name": output, "datatype": "FP64", "shape": first["shape"],
                         "data": [v * factor for v in first["data"]]}],
        }

    return handler


def fails(status: int | None, message: str = "boom", headers: dict[str, str] | None = None) -> Handler:
    async def handler(doc: Any) -> Any:
        raise UpstreamFailure(status, message, headers)

    return handler


def answers(doc: Any) -> Handler:
    async def handler(_: Any) -> Any:
        return doc

    return handler


def hangs() -> Handler:
    async def handler(_: Any) -> Any:
        await asyncio.Event().wait()

    return handler


def echo_text(suffix: str) -> Handler:
    async def handler(doc: Any) -> Any:
        return {"model_name": suffix, "text_output": doc["text_input"] + suffix}

    return handler


def graph(nodes: dict[str, Any], services: list[str], **extra: Any) -> RouterConfig:
    """A RouterConfig in its camelCase ConfigMap form (what the operator renders)."""
    return RouterConfig.model_validate({
        "graphName": "g",
        "nodes": nodes,
        "services": {s: {"url": f"http://{s}.ns.svc", "modelName": s} for s in services},
        **extra,
    })


def infer_request(*values: float, **extra: Any) -> Payload:
    doc = {"inputs": [{"name": "x", "datatype": "FP64", "shape": [len(values)], "data": list(values)}], **extra}
    return Payload(json.dumps(doc).encode())


@contextlib.contextmanager
def serving(app: ASGIApp, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn (as the pod does) on a free 127.0.0.1 port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)


@dataclass
class FakeChat:
    """A fake OpenAI chat service for router tests: a real Starlette app (serve it with :func:`serving`) that
    answers ``POST /v1/chat/completions`` with ``prefix`` + the last message's content, streamed one character per
    chunk when asked, and records each request's body and headers. ``fail`` set: every request answers that status
    with an OpenAI-shaped error."""

    prefix: str
    fail: int | None = None
    break_after: int | None = None  # a stream broken off (connection dropped) after this many chunks
    requests: list[tuple[dict[str, Any], dict[str, str]]] = field(default_factory=list)

    def app(self) -> ASGIApp:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def chat(request: Request) -> Response:
            doc = await request.json()
            self.requests.append((doc, dict(request.headers)))
            if self.fail is not None:
                error = {"message": f"{self.prefix} refused", "type": "rate_limit_error", "code": "rate_limited"}
                return JSONResponse({"error": error}, status_code=self.fail, headers={"retry-after": "7"})
            text = self.prefix + doc["messages"][-1]["content"]
            base = {"id": "chatcmpl-1", "created": 1, "model": doc["model"]}
            if not doc.get("stream"):
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                return JSONResponse({**base, "object": "chat.completion", "choices": [choice]})

            async def events() -> AsyncIterator[bytes]:
                for index, char in enumerate(text):
                    if index == self.break_after:
                        raise RuntimeError("the fake chat service broke off its stream")
                    choice = {"index": 0, "delta": {"content": char}, "finish_reason": None}
                    chunk = {**base, "object": "chat.completion.chunk", "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def bag_of_words(text: str, dimension: int = 32) -> list[float]:
    """A deterministic toy embedding (hashed word counts, unit length): similar words, near vectors."""
    import hashlib
    import math
    import re

    vector = [0.0] * dimension
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        vector[int(hashlib.sha256(word.encode()).hexdigest(), 16) % dimension] += 1.0
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


@dataclass
class FakeVectorStore:
    """An embedding service (``POST /v1/embeddings``) and a Feast feature server's vector search (``POST /search``,
    api_version 2) in one Starlette app, for router tests: the documents are ``{id: (text, topic)}``, embedded with
    :func:`bag_of_words`, searched exactly by cosine distance and answered in Feast's column-wise form (rows in
    join-key order, as Loom's sqlite-vec store sends them). ``fail_embed`` / ``fail_search``: answer that status."""

    documents: dict[str, tuple[str, str]]
    view: str = "docs"
    fail_embed: int | None = None
    fail_search: int | None = None
    embed_requests: list[dict[str, Any]] = field(default_factory=list)
    search_requests: list[dict[str, Any]] = field(default_factory=list)

    def store(self, url: str) -> dict[str, Any]:
        """The router's VectorStoreConfig (camelCase) for this fake served at ``url``."""
        return {
            "searchUrl": f"{url}/search", "featureRefs": [f"{self.view}:text", f"{self.view}:topic"],
            "textField": "text", "metric": "cosine",
            "embedding": {"url": f"{url}/v1/embeddings", "modelName": "toy-embedder"},
        }

    def app(self) -> ASGIApp:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        vectors: dict[str, list[float]] = {}

        async def embed(request: Request) -> Response:
            doc = await request.json()
            self.embed_requests.append(doc)
            if self.fail_embed is not None:
                return JSONResponse({"error": {"message": "embedder down"}}, status_code=self.fail_embed)
            data = [{"object": "embedding", "index": 0, "embedding": bag_of_words(doc["input"])}]
            return JSONResponse({"object": "list", "model": doc["model"], "data": data})

        async def search(request: Request) -> Response:
            doc = await request.json()
            self.search_requests.append(doc)
            if self.fail_search is not None:
                return JSONResponse({"detail": "store down"}, status_code=self.fail_search)
            query = doc["query"]
            scored = []
            for doc_id, (text, topic) in self.documents.items():
                if doc_id not in vectors:
                    vectors[doc_id] = bag_of_words(text)
                similarity = sum(a * b for a, b in zip(query, vectors[doc_id], strict=True))
                scored.append((1.0 - similarity, doc_id, text, topic))
            nearest = sorted(scored)[: doc["top_k"]]
            rows = sorted(nearest, key=lambda row: row[1])
            columns = {"text": [r[2] for r in rows], "topic": [r[3] for r in rows],
                       "distance": [r[0] for r in rows], "doc_id": [r[1] for r in rows]}
            results = [{"values": values, "statuses": ["PRESENT"] * len(values)} for values in columns.values()]
            return JSONResponse({"metadata": {"feature_names": list(columns)}, "results": results})

        return Starlette(routes=[
            Route("/v1/embeddings", embed, methods=["POST"]), Route("/search", search, methods=["POST"]),
        ])
