"""The activator's HTTP side: every request, any path and method, held if need be and then forwarded.

Answers of its own (JSON like the model server's errors, never from a model):
- 503 + Retry-After `{"code": "activator_timeout"}` when no replica became Ready within the bound, and
  `{"code": "activator_overloaded"}` when the caps on held requests or bytes are reached;
- 413 for a body larger than the held-bytes cap, 502 when the replica broke off before answering.
The admin app (its own port) serves /healthz and /metrics, so no model path is ever shadowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .config import ActivatorConfig
from .hold import Holder, Refused
from .metrics import ActivatorMetrics
from .proxy import Unreachable, Upstream, raw_response_headers, relay, request_headers

log = logging.getLogger("loom.workloads.activator")

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# After a refused connection (a replica going away under us), the next try waits this long at most.
RETRY_PAUSE_S = 0.1


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "code": code}, status_code=status, headers=headers)


def _path(request: Request) -> str:
    raw: bytes = request.scope.get("raw_path") or request.scope["path"].encode()
    query: bytes = request.scope.get("query_string") or b""
    return (raw + (b"?" + query if query else b"")).decode("latin-1")


async def read_body(request: Request, cap: int, outcome: Callable[[str], None], code: str) -> bytes | Response:
    """The body to forward, or the answer instead of it: 499 (counted client_gone) when the caller left while it
    arrived, 413 (too_large, `code`) past `cap` bytes."""
    try:
        body = await _read_capped(request, cap)
    except ClientDisconnect:
        outcome("client_gone")
        return Response(status_code=499)
    if body is None:
        outcome("too_large")
        return _error(413, f"request body over {cap} bytes", code)
    return body


async def _read_capped(request: Request, cap: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed `cap` bytes (never read whole into memory)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_gone(request: Request) -> None:
    """Returns when the caller disconnects (the body was read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(
    config: ActivatorConfig,
    holder: Holder,
    upstream: Upstream,
    metrics: ActivatorMetrics,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    retry_after = {"Retry-After": str(config.retry_after_seconds)}

    async def held_target(request: Request, size: int, deadline: float) -> tuple[str, bool] | None:
        """The endpoint (and whether the request was held), or None when the caller left while held."""
        waiting = asyncio.ensure_future(holder.target(size, deadline))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            return None
        return waiting.result()

    async def forward(request: Request) -> Response:
        arrived = clock()
        deadline = arrived + config.timeout_seconds
        body = await read_body(request, config.max_held_bytes, metrics.outcome, "activator_too_large")
        if isinstance(body, Response):
            return body
        headers = request_headers(request.headers.items(), request.client.host if request.client else None)
        held_once = False
        while True:
            try:
                found = await held_target(request, len(body), deadline)
            except Refused as refused:
                metrics.outcome(refused.outcome)
                log.warning("503 for %s %s: %s", request.method, request.url.path, refused.message)
                return _error(503, refused.message, f"activator_{refused.outcome}", retry_after)
            if found is None:
                metrics.outcome("client_gone")
                return Response(status_code=499)
            endpoint, held = found
            held_once = held_once or held
            try:
                response = await upstream.send(endpoint, request.method, _path(request), headers, body)
            except Unreachable as exc:
                # Nothing was sent: the replica is going away. Another one, or hold again, within the same bound.
                log.info("replica unreachable (%s); trying again", exc)
                holder.targets.forget(endpoint)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                metrics.outcome("upstream_error")
                return _error(502, f"the replica broke off: {type(exc).__name__}", "activator_upstream")
            break
        metrics.outcome("held_forwarded" if held_once else "forwarded")
        answer = StreamingResponse(relay(response), status_code=response.status)
        answer.raw_headers = raw_response_headers(response.headers.items())
        return answer

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await holder.aclose()
            await upstream.aclose()

    routes = [
        Route("/", forward, methods=METHODS),
        Route("/{path:path}", forward, methods=METHODS),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def build_admin_app(metrics: ActivatorMetrics, ready: Callable[[], bool]) -> Starlette:
    """/healthz (200 once the first pod list arrived: the activator knows where to send requests) and /metrics."""

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok") if ready() else PlainTextResponse("pods not listed yet", status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/healthz", healthz), Route("/metrics", prometheus)])
