"""The HTTP side: Open Inference Protocol v2 REST, the generate extension (with SSE streaming),
health, metadata and /metrics, over Starlette. Model code never sees any of this."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import iterate_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loom.workloads.server.batching import AdaptiveBatcher, QueueFullError, ShuttingDownError
from loom.workloads.server.config import ServerConfig
from loom.workloads.server.flow import ApiKeys, RateLimiter
from loom.workloads.server.guard import GuardMiddleware
from loom.workloads.server.metrics import NvmlCollector, ServerMetrics
from loom.workloads.server.model import InferRequest, Model, ModelError, Tensor, TensorSpec
from loom.workloads.server.protocol import ProtocolError, decode_infer_request, encode_infer_response

log = logging.getLogger(__name__)

SERVER_NAME = "loom-model-server"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "generate", "generate_stream"]


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class ServerState:
    """What the endpoints share: the model, its batcher, metrics, and whether it is loaded."""

    def __init__(self, config: ServerConfig, model: Model, metrics: ServerMetrics):
        self.config = config
        self.model = model
        self.metrics = metrics
        self.batcher = AdaptiveBatcher(model.predict, config.batching, metrics)
        self.load_error: str | None = None
        self.streams = 0
        self.on_load_failed: Callable[[str], None] | None = None

    @property
    def ready(self) -> bool:
        return self.model.ready and self.load_error is None

    def load(self, folder: Path) -> None:
        try:
            self.model.load(folder)
            self.model.ready = True
            self.metrics.ready.labels(self.model.name).set(1)
            log.info("model %s version %s loaded from %s", self.model.name, self.model.version, folder)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("loading model %s failed", self.model.name)
            if self.on_load_failed is not None:
                self.on_load_failed(self.load_error)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def build_app(config: ServerConfig, model: Model, model_folder: Path | None = None) -> Starlette:
    """The ASGI app for one model. The model is loaded in the background after startup, so liveness
    answers at once and readiness turns true only once the model is loaded."""
    metrics = ServerMetrics(model.name, gpu=NvmlCollector.create())
    state = ServerState(config, model, metrics)
    folder = model_folder or Path(config.model_dir)

    def resolve(request: Request) -> Model:
        name = request.path_params["name"]
        version = request.path_params.get("version")
        if name != model.name:
            raise HTTPError(404, f"model {name!r} not found")
        if version is not None and model.version is not None and version != model.version:
            raise HTTPError(404, f"model {name!r} has no version {version!r} (serving {model.version})")
        return model

    def require_ready() -> None:
        if not state.ready:
            reason = f": {state.load_error}" if state.load_error else ""
            raise HTTPError(503, f"model {model.name} is not ready{reason}")

    def measured(endpoint: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def wrapped(request: Request) -> Response:
            started = time.perf_counter()
            try:
                response: Response = await handler(request)
            except HTTPError as exc:
                response = _error(exc.status, str(exc), exc.headers)
            except ProtocolError as exc:
                response = _error(exc.status, str(exc))
            except Exception as exc:  # a server bug: still a JSON error, and still counted
                log.exception("%s failed", endpoint)
                response = _error(500, f"internal error: {type(exc).__name__}")
            metrics.answered(endpoint, response.status_code, time.perf_counter() - started)
            return response

        return wrapped

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def model_ready(request: Request) -> Response:
        found = resolve(request)
        return JSONResponse({"name": found.name, "ready": state.ready}, status_code=200 if state.ready else 503)

    async def model_metadata(request: Request) -> Response:
        found = resolve(request)

        def spec(tensor: TensorSpec) -> dict[str, Any]:
            return {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}

        return JSONResponse({
            "name": found.name,
            "versions": [found.version] if found.version else [],
            "platform": found.platform,
            "inputs": [spec(t) for t in found.inputs()],
            "outputs": [spec(t) for t in found.outputs()],
        })

    async def run(infer_request: InferRequest) -> Any:
        metrics.inflight.labels(model.name).inc()
        try:
            return await state.batcher.submit(infer_request)
        except QueueFullError as exc:
            raise HTTPError(503, str(exc), {"retry-after": "1"}) from exc
        except ShuttingDownError as exc:
            raise HTTPError(503, str(exc)) from exc
        except (ModelError, ProtocolError) as exc:
            raise HTTPError(400, str(exc)) from exc
        except Exception as exc:
            raise HTTPError(500, f"{type(exc).__name__}: {exc}") from exc
        finally:
            metrics.inflight.labels(model.name).dec()

    async def infer(request: Request) -> Response:
        found = resolve(request)
        require_ready()
        decoded = decode_infer_request(await request.body(), request.headers.get("inference-header-content-length"))
        result = await run(decoded.request)
        body, headers = encode_infer_response(found.name, found.version, decoded, result)
        return Response(body, headers=headers)

    async def generate_request(request: Request) -> tuple[dict[str, Any], str, dict[str, Any]]:
        try:
            doc = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("text_input"), str):
            raise HTTPError(400, "generate needs a JSON object with a string 'text_input'")
        parameters = doc.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise HTTPError(400, "'parameters' must be an object")
        return doc, doc["text_input"], parameters

    def envelope(found: Model, doc: dict[str, Any], text: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model_name": found.name, "model_version": found.version, "text_output": text}
        if isinstance(doc.get("id"), str):
            out["id"] = doc["id"]
        return out

    async def generate(request: Request) -> Response:
        """Non-streaming generate goes through the batcher: concurrent prompts share a forward pass."""
        found = resolve(request)
        require_ready()
        doc, text, parameters = await generate_request(request)
        prompt = np.array([text], dtype=object)
        infer_request = InferRequest(
            inputs={"text_input": Tensor("text_input", "BYTES", prompt)},
            parameters=parameters,
            requested_outputs=None,
            id=doc.get("id") if isinstance(doc.get("id"), str) else None,
        )
        result = await run(infer_request)
        texts = [t for t in result.outputs if t.name == "text_output"] or [
            t for t in result.outputs if t.datatype == "BYTES"
        ]
        if not texts:
            raise HTTPError(500, "model produced no text output")
        value = np.asarray(texts[0].data).reshape(-1)[0]
        output = value.decode() if isinstance(value, bytes) else str(value)
        return JSONResponse(envelope(found, doc, output))

    async def generate_stream(request: Request) -> Response:
        found = resolve(request)
        require_ready()
        if not found.supports_generate:
            raise HTTPError(400, f"model {found.name} does not support streaming generate")
        doc, text, parameters = await generate_request(request)
        if state.streams >= config.batching.max_queue:
            raise HTTPError(503, "too many concurrent streams", {"retry-after": "1"})
        state.streams += 1
        metrics.inflight.labels(model.name).inc()

        async def events() -> AsyncIterator[str]:
            try:
                async for piece in iterate_in_threadpool(found.generate(text, parameters)):
                    metrics.tokens.labels(model.name).inc()
                    yield f"data: {json.dumps(envelope(found, doc, piece))}\n\n"
            except Exception as exc:  # the stream has started: the error travels as an event
                log.warning("generate_stream failed: %s", exc)
                yield f"data: {json.dumps({'error': f'{type(exc).__name__}: {exc}'})}\n\n"
            finally:
                state.streams -= 1
                metrics.inflight.labels(model.name).dec()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )

    async def prometheus(request: Request) -> Response:
        metrics.queue_depth(state.batcher.depth)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    model_routes: list[tuple[str, Callable[[Request], Any], str, str]] = [
        ("", model_metadata, "GET", "metadata"),
        ("/ready", model_ready, "GET", "model_ready"),
        ("/infer", infer, "POST", "infer"),
        ("/generate", generate, "POST", "generate"),
        ("/generate_stream", generate_stream, "POST", "generate_stream"),
    ]
    routes = [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", measured("server_metadata", server_metadata), methods=["GET"]),
    ]
    for suffix, handler, method, endpoint in model_routes:
        wrapped = measured(endpoint, handler)
        routes.append(Route(f"/v2/models/{{name}}{suffix}", wrapped, methods=[method]))
        routes.append(Route(f"/v2/models/{{name}}/versions/{{version}}{suffix}", wrapped, methods=[method]))
    if config.metrics_port is None:
        routes.append(Route("/metrics", prometheus, methods=["GET"]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.batcher.start()
        loader = asyncio.get_running_loop().run_in_executor(None, state.load, folder)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(loader), timeout=0.1)
            await state.batcher.stop()

    keys = ApiKeys(config.auth)
    limiter = RateLimiter(config.auth.rate_limit) if config.auth.rate_limit else None
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(GuardMiddleware, keys=keys, limiter=limiter, metrics=metrics)],
    )

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no route for {request.method} {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} not allowed on {request.url.path}")

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    app.state.server = state
    return app
