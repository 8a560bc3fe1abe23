"""The HTTP side, over Starlette: Open Inference Protocol v2 REST, the generate extension (with SSE
streaming), health and /metrics.

Routes only parse HTTP, call the data plane (dataplane.py) and turn its answers into responses and
its typed errors (errors.py) into status codes. API keys and rate limits are middleware (guard.py).
Model code never sees any of this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loom.workloads.common.body_limit import BodyLimit

from .config import ServerConfig
from .dataplane import DataPlane
from .enrichment import Enricher
from .errors import (
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    ServerError,
    UnavailableError,
)
from .flow import ApiKeys, RateLimiter
from .guard import GuardMiddleware
from .lifecycle import CloseWhileDraining, Drain
from .metrics import NvmlCollector, ServerMetrics
from .model import Model
from .protocol import (
    HEADER_LENGTH,
    ProtocolError,
    decode_generate_request,
    decode_infer_request,
    encode_infer_response,
)

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

# Most specific first: OverloadedError is an UnavailableError that also asks the client to retry.
STATUS_CODES: tuple[tuple[type[ServerError], int], ...] = (
    (ModelNotFoundError, 404),
    (ModelNotReadyError, 503),
    (OverloadedError, 503),
    (UnavailableError, 503),
    (InvalidInputError, 400),
    (InferenceError, 500),
)


def status_of(error: ServerError) -> int:
    return next((code for kind, code in STATUS_CODES if isinstance(error, kind)), 500)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _version(request: Request) -> str | None:
    version = request.path_params.get("version")
    return str(version) if version is not None else None


class Routes:
    """The endpoints of one app; each is a few lines around one data-plane call."""

    def __init__(self, plane: DataPlane, drain: Drain | None = None):
        self.plane = plane
        self.drain = drain or Drain()

    def measured(self, endpoint: str, handler: Endpoint) -> Endpoint:
        """Map errors to JSON responses and count every answer under ``endpoint``."""
        metrics = self.plane.metrics

        async def wrapped(request: Request) -> Response:
            started = time.perf_counter()
            try:
                response = await handler(request)
            except ServerError as exc:
                retry = {"retry-after": str(exc.retry_after_s)} if isinstance(exc, OverloadedError) else None
                response = error_response(status_of(exc), str(exc), retry)
            except ProtocolError as exc:
                response = error_response(exc.status, str(exc))
            except Exception as exc:  # a server bug: still a JSON error, and still counted
                log.exception("%s failed", endpoint)
                response = error_response(500, f"internal error: {type(exc).__name__}")
            metrics.answered(endpoint, response.status_code, time.perf_counter() - started)
            return response

        return wrapped

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = self.plane.ready and not self.drain.active  # draining: the Service should send no more
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse(self.plane.server_metadata().to_dict())

    async def model_ready(self, request: Request) -> Response:
        name = request.path_params["name"]
        ready = self.plane.model_ready(name, _version(request)) and not self.drain.active
        return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)

    async def model_metadata(self, request: Request) -> Response:
        return JSONResponse(self.plane.model_metadata(request.path_params["name"], _version(request)).to_dict())

    async def infer(self, request: Request) -> Response:
        name, version = request.path_params["name"], _version(request)
        model = self.plane.ready_model(name, version)  # 404/503 before the body is read
        decoded = decode_infer_request(await request.body(), request.headers.get(HEADER_LENGTH))
        result = await self.plane.infer(name, version, decoded.request)
        body, headers = encode_infer_response(model.name, model.version, decoded, result)
        return Response(body, headers=headers)

    async def generate(self, request: Request) -> Response:
        name, version = request.path_params["name"], _version(request)
        self.plane.ready_model(name, version)
        answer = await self.plane.generate(name, version, decode_generate_request(await request.body()))
        return JSONResponse(answer.to_dict())

    async def generate_stream(self, request: Request) -> Response:
        name, version = request.path_params["name"], _version(request)
        self.plane.ready_model(name, version)
        pieces = self.plane.generate_stream(name, version, decode_generate_request(await request.body()))

        async def events() -> AsyncIterator[str]:
            async with contextlib.aclosing(pieces):
                try:
                    async for piece in pieces:
                        yield f"data: {json.dumps(piece.to_dict())}\n\n"
                except ServerError as exc:  # the stream has started: the error travels as an event
                    yield f"data: {json.dumps({'error': str(exc)})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def prometheus(self, request: Request) -> Response:
        metrics = self.plane.metrics
        metrics.queue_depth(self.plane.queue_depth)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def table(self, with_metrics: bool) -> list[Route]:
        model_routes: list[tuple[str, Endpoint, str, str]] = [
            ("", self.model_metadata, "GET", "metadata"),
            ("/ready", self.model_ready, "GET", "model_ready"),
            ("/infer", self.infer, "POST", "infer"),
            ("/generate", self.generate, "POST", "generate"),
            ("/generate_stream", self.generate_stream, "POST", "generate_stream"),
        ]
        routes = [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2", self.measured("server_metadata", self.server_metadata), methods=["GET"]),
        ]
        for suffix, handler, method, endpoint in model_routes:
            wrapped = self.measured(endpoint, handler)
            routes.append(Route(f"/v2/models/{{name}}{suffix}", wrapped, methods=[method]))
            routes.append(Route(f"/v2/models/{{name}}/versions/{{version}}{suffix}", wrapped, methods=[method]))
        if with_metrics:
            routes.append(Route("/metrics", self.prometheus, methods=["GET"]))
        return routes


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route for {request.method} {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"method {request.method} not allowed on {request.url.path}")


def build_app(
    config: ServerConfig, model: Model, model_folder: Path | None = None, drain: Drain | None = None
) -> Starlette:
    """The ASGI app for one model. The model is loaded in the background after startup, so liveness
    answers at once and readiness turns true only once the model is loaded. The data plane is
    ``app.state.plane``; ``drain`` (lifecycle.py) turns readiness off and keep-alive off on SIGTERM."""
    drain = drain or Drain()
    metrics = ServerMetrics(model.name, gpu=NvmlCollector.create())
    enricher = Enricher(config.features, model.name, metrics.registry) if config.features is not None else None
    plane = DataPlane(model, config.batching, metrics, enricher)
    folder = model_folder or Path(config.model_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await plane.start(folder)
        try:
            yield
        finally:
            await plane.stop()

    limiter = RateLimiter(config.auth.rate_limit) if config.auth.rate_limit else None
    guard = Middleware(GuardMiddleware, keys=ApiKeys(config.auth), limiter=limiter, metrics=plane.metrics)
    app = Starlette(
        routes=Routes(plane, drain).table(with_metrics=config.metrics_port is None),
        lifespan=lifespan,
        middleware=[
            Middleware(CloseWhileDraining, drain=drain),
            guard,
            Middleware(BodyLimit, max_bytes=config.max_request_bytes, timeout_s=config.request_body_timeout_s),
        ],
        exception_handlers={404: _not_found, 405: _not_allowed},
    )
    app.state.plane = plane
    return app
