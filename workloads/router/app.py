"""The router's HTTP side: the graph served as one Open Inference Protocol v2 model, over Starlette, or, when its
steps are ``protocol: openai-chat``, as one OpenAI chat model (``GET /v1/models``, ``POST /v1/chat/completions``
with ``model`` the graph's name, streaming or not; errors OpenAI-shaped, see :mod:`openai_chat`).

Every answer carries ``loom-graph-steps`` (``node.step=outcome,...``): which steps ran, were skipped
after a Soft failure, failed, or were not taken, so a graph can be debugged from one response.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loom.workloads.common.body_limit import BodyLimit
from loom.workloads.common.lifecycle import CloseWhileDraining, Drain

from .conditions import Condition, compile_conditions
from .config import RouterConfig
from .engine import GraphEngine, Outcome
from .errors import GraphError, StepRecord
from .metrics import RouterMetrics
from .openai_chat import DONE, check_request, completion_as_chunk, error_body, graph_error_body, sse
from .payload import Endpoint, Payload, PayloadError
from .retrieval import Retrieval
from .retrieval_io import HttpRetriever
from .sources import DEGRADED_HEADER, SOURCES_HEADER, sources_header, with_sources
from .upstream import Caller, Stream, Upstreams, forwarded_headers

log = logging.getLogger(__name__)

SERVER_NAME = "loom-graph-router"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "generate", "generate_stream"]
STEPS_HEADER = "loom-graph-steps"


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": message, "code": code}, status_code=status)


def _steps_header(steps: list[StepRecord]) -> dict[str, str]:
    return {STEPS_HEADER: ",".join(record.header_value() for record in steps)}


def _retrieval_headers(retrieval: Retrieval | None) -> dict[str, str]:
    """Which documents the answer was given from (and, when it was given without any, why)."""
    if retrieval is None:
        return {}
    headers = {SOURCES_HEADER: sources_header(retrieval.sources)}
    if retrieval.degraded is not None:
        # One header line of printable ASCII: the reason may quote an upstream's text.
        reason = "".join(c if " " <= c <= "~" else "?" for c in retrieval.degraded)
        headers[DEGRADED_HEADER] = reason[:500]
    return headers


def build_app(
    config: RouterConfig,
    caller: Caller | None = None,
    engine: GraphEngine | None = None,
    conditions: dict[tuple[str, int], Condition] | None = None,
    drain: Drain | None = None,
) -> Starlette:
    """The ASGI app for one graph. ``caller`` defaults to pooled HTTP clients for ``config.services``
    (closed on shutdown); ``engine`` may be given whole, e.g. with a seeded RNG in tests. ``drain``
    (loom.workloads.common.lifecycle) turns readiness and keep-alive off on SIGTERM."""
    drain = drain or Drain()
    graph = config.graph_name
    metrics = engine.metrics if engine is not None else RouterMetrics(graph)
    upstreams: Upstreams | None = None
    retriever: HttpRetriever | None = None
    if engine is None:
        if caller is None:
            steps = [step for node in config.nodes.values() for step in node.steps]
            longest = max([config.step_timeout_ms, *(step.timeout_ms or 0 for step in steps)])
            upstreams = Upstreams(config.services, longest / 1000.0, config.max_connections)
            caller = upstreams
        if any(step.retrieve for node in config.nodes.values() for step in node.steps):
            retriever = HttpRetriever(config.max_connections)
        engine = GraphEngine(
            config, caller, compile_conditions(config) if conditions is None else conditions, metrics=metrics,
            retriever=retriever,
        )
    ready = {"value": False}

    chat_graph = config.protocol == "openai-chat"

    def measured(
        endpoint: str, handler: Callable[[Request], Awaitable[Response]], openai: bool = False
    ) -> Callable[[Request], Any]:
        def refuse(status: int, message: str, code: str) -> Response:
            if openai:
                return JSONResponse(error_body(status, message, code), status_code=status)
            return _error(status, message, code)

        async def wrapped(request: Request) -> Response:
            started = time.perf_counter()
            if request.path_params.get("name", graph) != graph:
                response: Response = refuse(404, f"model {request.path_params['name']!r} not found", "not_found")
            elif openai != chat_graph and endpoint not in ("server_metadata", "metadata", "model_ready"):
                speaks = "OpenAI chat: POST /v1/chat/completions" if chat_graph else "OIP v2: /v2/models/{name}/..."
                response = refuse(404, f"graph {graph!r} speaks {speaks}", "wrong_protocol")
            else:
                metrics.inflight.labels(graph).inc()
                try:
                    response = await handler(request)
                except GraphError as exc:
                    if exc.status >= 500:
                        log.warning("graph %s failed: %s", graph, exc.describe())
                    doc = graph_error_body(exc, graph) if openai else exc.to_json(graph)
                    response = JSONResponse(
                        doc, status_code=exc.status, headers={**exc.headers, **_steps_header(exc.steps)}
                    )
                except Exception as exc:  # a router bug: still a JSON error, and still counted
                    log.exception("%s failed", endpoint)
                    response = refuse(500, f"internal error: {type(exc).__name__}", "internal")
                finally:
                    metrics.inflight.labels(graph).dec()
            metrics.answered(endpoint, response.status_code, time.perf_counter() - started)
            return response

        return wrapped

    async def execute(request: Request, endpoint: Endpoint, stream: bool = False) -> Outcome:
        body = await request.body()
        try:
            payload = Payload.from_http(body, request.headers, "request")
        except PayloadError as exc:
            raise GraphError("bad_request", 400, str(exc)) from exc
        return await engine.run(payload, endpoint, forwarded_headers(request.headers), stream=stream)

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    def is_ready() -> bool:
        return ready["value"] and not drain.active  # draining: the Service should send no more

    async def health_ready(request: Request) -> Response:
        return JSONResponse({"ready": is_ready()}, status_code=200 if is_ready() else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def model_metadata(request: Request) -> Response:
        # A graph has no fixed signature of its own: its inputs are its first steps' and its outputs
        # depend on the route taken, so they are left empty (the protocol allows it).
        return JSONResponse({"name": graph, "versions": [], "platform": "loom-graph", "inputs": [], "outputs": []})

    async def model_ready(request: Request) -> Response:
        return JSONResponse({"name": graph, "ready": is_ready()}, status_code=200 if is_ready() else 503)

    async def infer(request: Request) -> Response:
        outcome = await execute(request, "infer")
        assert isinstance(outcome.value, Payload)
        return Response(outcome.value.body, headers={**outcome.value.http_headers(), **_steps_header(outcome.steps)})

    async def generate(request: Request) -> Response:
        outcome = await execute(request, "generate")
        assert isinstance(outcome.value, Payload)
        return Response(outcome.value.body, headers={**outcome.value.http_headers(), **_steps_header(outcome.steps)})

    async def generate_stream(request: Request) -> Response:
        outcome = await execute(request, "generate", stream=True)
        value = outcome.value
        events = _relay(value) if isinstance(value, Stream) else _one_event(value)
        headers = {"cache-control": "no-cache", **_steps_header(outcome.steps)}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def list_models(request: Request) -> Response:
        model = {"id": graph, "object": "model", "created": 0, "owned_by": "loom-graph"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(request: Request) -> Response:
        body = await request.body()
        payload = Payload.from_http(body, {"content-type": "application/json"}, "request")
        doc = check_request(payload)
        if doc.get("model", graph) != graph:
            message = f"model {doc['model']!r} is not served here (this graph: {graph!r})"
            raise GraphError("model_not_found", 404, message)
        stream = doc.get("stream") is True
        outcome = await engine.run(payload, "chat", forwarded_headers(request.headers), stream=stream)
        value = outcome.value
        retrieval = outcome.retrieval
        answer_headers = {**_steps_header(outcome.steps), **_retrieval_headers(retrieval)}
        if not stream:
            assert isinstance(value, Payload)
            body = value.body if retrieval is None else with_sources(value.body, retrieval.sources)
            return Response(body, media_type="application/json", headers=answer_headers)
        events = _relay_chat(value) if isinstance(value, Stream) else _chat_one_event(value)
        headers = {"cache-control": "no-cache", **answer_headers}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", health_ready, methods=["GET"]),
        Route("/v2", measured("server_metadata", server_metadata), methods=["GET"]),
        Route("/v2/models/{name}", measured("metadata", model_metadata), methods=["GET"]),
        Route("/v2/models/{name}/ready", measured("model_ready", model_ready), methods=["GET"]),
        Route("/v2/models/{name}/infer", measured("infer", infer), methods=["POST"]),
        Route("/v2/models/{name}/generate", measured("generate", generate), methods=["POST"]),
        Route("/v2/models/{name}/generate_stream", measured("generate_stream", generate_stream), methods=["POST"]),
        Route("/v1/models", measured("models", list_models, openai=True), methods=["GET"]),
        Route("/v1/chat/completions", measured("chat_completions", chat_completions, openai=True), methods=["POST"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ready["value"] = True
        try:
            yield
        finally:
            ready["value"] = False
            if upstreams is not None:
                await upstreams.aclose()
            if retriever is not None:
                await retriever.aclose()

    limit = Middleware(BodyLimit, max_bytes=config.max_request_bytes, timeout_s=config.request_body_timeout_s)
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=[Middleware(CloseWhileDraining, drain=drain), limit]
    )

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no route for {request.method} {request.url.path}", "not_found")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} not allowed on {request.url.path}", "method_not_allowed")

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    app.state.engine = engine
    app.state.metrics = metrics
    return app


async def _relay(stream: Stream) -> AsyncIterator[bytes]:
    """The streaming step's chunks, passed on as they arrive; a failure mid-stream becomes an error
    event (the 200 is already sent), the model server's way."""
    try:
        async for chunk in stream.chunks():
            yield chunk
    except Exception as exc:
        log.warning("stream through the graph broke: %s", exc)
        event = {"error": f"stream broke: {type(exc).__name__}: {exc}", "code": "stream_error"}
        yield f"data: {json.dumps(event)}\n\n".encode()


async def _relay_chat(stream: Stream) -> AsyncIterator[bytes]:
    """The last chat step's SSE chunks as they arrive (its own ``data: [DONE]`` included); a failure mid-stream
    becomes an OpenAI error event and ``[DONE]``, the 200 being already sent."""
    try:
        async for chunk in stream.chunks():
            yield chunk
    except Exception as exc:
        log.warning("chat stream through the graph broke: %s", exc)
        yield sse(error_body(502, f"stream broke: {type(exc).__name__}: {exc}", "stream_error"))
        yield DONE


async def _chat_one_event(payload: Payload) -> AsyncIterator[bytes]:
    """A complete chat answer (the last step was skipped after a Soft failure) as one chunk and ``[DONE]``."""
    yield completion_as_chunk(payload)
    yield DONE


async def _one_event(payload: Payload) -> AsyncIterator[bytes]:
    """A complete body (the last position was an Ensemble, or was skipped) as one event."""
    try:
        doc = payload.doc()
    except PayloadError:
        doc = {"text_output": payload.body.decode("utf-8", "replace")}
    yield f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()
