"""The HTTP side of the vllm runtime, over Starlette: the OpenAI-compatible API, the OIP v2 generate
extension for the same model, health and /metrics.

Routes check requests (openai_protocol.py), hand them to the engine (engine.py), and on the way back count
tokens against the caller's budget and record the LLM metrics. Keys and request budgets are middleware
(guard.py); request size and body-read time are the shared BodyLimit; SIGTERM drains as on the model server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loom.workloads.common.body_limit import BodyLimit
from loom.workloads.common.lifecycle import CloseWhileDraining, Drain
from loom.workloads.server.flow import ANONYMOUS, ApiKeys
from loom.workloads.server.protocol import ProtocolError, decode_generate_request

from .adapter_manager import AdapterManager
from .adapters import ADAPTERS_PATH
from .budget import RequestBudget, TokenBudget
from .config import LlmServerConfig
from .engine import EngineUnavailable, VllmEngine
from .guard import LlmGuard
from .metrics import LlmMetrics
from .openai_protocol import (
    Kind,
    LlmRequest,
    OpenAIError,
    body_limit_error,
    completion_to_generate,
    engine_error,
    generate_to_completion,
    parse_request,
    sse,
    usage_tokens,
)
from .sse_relay import SseRelay, events
from .sse_response import SseResponse
from .tokenizer_files import PATHS as TOKENIZER_PATHS
from .tokenizer_files import TOKENIZER_PATH, tokenizer_digest, tokenizer_file

log = logging.getLogger(__name__)
Endpoint = Callable[[Request], Awaitable[Response]]
SSE_HEADERS = {"cache-control": "no-cache"}


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


class LlmRoutes:
    def __init__(self, config: LlmServerConfig, engine: VllmEngine, metrics: LlmMetrics, drain: Drain,
                 tokens: TokenBudget | None, adapters: AdapterManager | None = None) -> None:
        self.config, self.engine, self.metrics, self.drain, self.tokens = config, engine, metrics, drain, tokens
        self.adapters = adapters
        self.ready = False  # set once the engine answers its health check
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------- plumbing
    def measured(self, endpoint: str, handler: Endpoint) -> Endpoint:
        """Map every refusal and failure to an OpenAI-shaped answer, and count it under ``endpoint``."""

        async def wrapped(request: Request) -> Response:
            try:
                if self.drain.active:
                    raise OpenAIError(503, "the server is shutting down", "shutting_down")
                if not self.ready:
                    raise OpenAIError(503, "the model is still loading", "model_not_ready")
                response = await handler(request)
            except OpenAIError as exc:
                response = error_response(exc)
            except ProtocolError as exc:
                response = error_response(OpenAIError(exc.status, str(exc), "invalid_request"))
            except EngineUnavailable as exc:
                response = error_response(OpenAIError(503, str(exc), "engine_unavailable"))
            except TimeoutError:
                limit = self.config.limits.request_timeout_s
                response = error_response(OpenAIError(504, f"the request took longer than {limit:g} s", "timeout"))
            except Exception as exc:  # a bug: still an OpenAI-shaped error, and still counted
                log.exception("%s failed", endpoint)
                response = error_response(OpenAIError(500, f"internal error: {type(exc).__name__}", "internal_error"))
            self.metrics.answered(endpoint, response.status_code)
            return response

        return wrapped

    def _finish(self, request: Request, started: float, first: float | None, prompt: int, completion: int) -> None:
        caller = request.scope.get("state", {}).get("caller", ANONYMOUS)
        if self.tokens is not None:
            self.tokens.charge(caller, prompt + completion, time.monotonic())
        self.metrics.finished(started, first, time.perf_counter(), prompt, completion)

    async def _complete(self, request: Request, path: str, parsed: LlmRequest) -> dict[str, Any]:
        started = time.perf_counter()
        async with asyncio.timeout(self.config.limits.request_timeout_s):
            status, body = await self.engine.post(path, parsed.engine_body)
        if status != 200:
            raise engine_error(status, body)
        doc: dict[str, Any] = json.loads(body)
        self._finish(request, started, None, *usage_tokens(doc))
        return doc

    async def _open_stream(
        self, request: Request, path: str, parsed: LlmRequest, stack: contextlib.AsyncExitStack | None = None,
        model: str | None = None,
    ) -> tuple[AsyncIterator[bytes], SseRelay]:
        """Start the engine's stream (so an engine refusal is still an HTTP error) and return its events as the
        client gets them, by the bytes (sse_relay.py: the usage read from them, charged and measured here at the
        end; its event dropped unless the client asked). ``stack`` is closed when the stream ends (what the request
        holds, its adapter version); ``model`` replaces the engine's model name in the events (an adapter's name
        for its version's engine name)."""
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.config.limits.request_timeout_s
        stack = stack or contextlib.AsyncExitStack()
        try:
            status, data, error = await stack.enter_async_context(self.engine.stream(path, parsed.engine_body))
        except BaseException:
            await stack.aclose()
            raise
        if status != 200:
            await stack.aclose()
            raise engine_error(status, error)
        relay = SseRelay(parsed.include_usage, parsed.engine_body["model"], model)

        async def pieces() -> AsyncIterator[bytes]:
            first: float | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    # Read to the end, past [DONE]: the engine's connection then goes back to the pool.
                    async for chunk in data:
                        piece = relay.feed(chunk)
                        if first is None and relay.text_started:
                            first = time.perf_counter()
                        if piece:
                            yield piece
                    if last := relay.end():
                        yield last
                self._finish(request, started, first, *relay.usage)
            finally:
                await stack.aclose()

        return pieces(), relay

    def _sse(self, pieces: AsyncIterator[bytes], end: Callable[[], bytes]) -> SseResponse:
        """The stream's pieces, one write each (what one read of the engine brought: never held for more), an
        error event if it fails, then ``end()``."""

        async def body() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(pieces):  # type: ignore[type-var]
                try:
                    async for piece in pieces:
                        yield piece
                except TimeoutError:
                    limit = self.config.limits.request_timeout_s
                    yield sse(OpenAIError(504, f"the stream took longer than {limit:g} s", "timeout").body())
                except EngineUnavailable as exc:
                    yield sse(OpenAIError(503, str(exc), "engine_unavailable").body())
            if last := end():
                yield last

        return SseResponse(body(), headers=SSE_HEADERS)

    def _openai_sse(self, opened: tuple[AsyncIterator[bytes], SseRelay]) -> SseResponse:
        """An OpenAI stream: the engine's own ``data: [DONE]`` ends it, or the front's when the engine's did not."""
        pieces, relay = opened
        return self._sse(pieces, lambda: b"" if relay.done else sse("[DONE]"))

    # ------------------------------------------------------------------------------------------- OpenAI
    async def _openai(self, request: Request, kind: Kind, path: str) -> Response:
        limits = self.config.limits
        names = self.adapters.names if self.adapters is not None else ()
        parsed = parse_request(kind, await request.body(), self.config.model_name, limits.max_tokens_limit,
                               adapters=names)
        model = parsed.engine_body["model"]
        if model == self.config.model_name or self.adapters is None:
            if parsed.stream:
                return self._openai_sse(await self._open_stream(request, path, parsed))
            return JSONResponse(await self._complete(request, path, parsed))
        # An adapter: the request takes its current version (by its engine name) and holds it until it ends, so
        # a newer version or a removal never unloads it under the request.
        manager = self.adapters
        key = manager.acquire(model)
        parsed = replace(parsed, engine_body={**parsed.engine_body, "model": key})
        if parsed.stream:
            stack = contextlib.AsyncExitStack()
            stack.callback(manager.release, key)
            return self._openai_sse(await self._open_stream(request, path, parsed, stack, model))
        try:
            doc = await self._complete(request, path, parsed)
        finally:
            manager.release(key)
        doc["model"] = model
        return JSONResponse(doc)

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, "completion", "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, "chat", "/v1/chat/completions")

    async def embeddings(self, request: Request) -> Response:
        """OpenAI embeddings, passed to the engine as they came (a pooling model: vLLM with ``--runner pooling``,
        e.g. ``--convert embed``); the served model only, its prompt tokens charged to the caller's budget."""
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise OpenAIError(400, "the body is not JSON", "invalid_request") from exc
        if not isinstance(body, dict) or body.get("model", self.config.model_name) != self.config.model_name:
            model = body.get("model") if isinstance(body, dict) else None
            raise OpenAIError(404, f"model '{model}' is not served here", "model_not_found")
        started = time.perf_counter()
        async with asyncio.timeout(self.config.limits.request_timeout_s):
            status, answer = await self.engine.post("/v1/embeddings", {**body, "model": self.config.model_name})
        if status != 200:
            raise engine_error(status, answer)
        self._finish(request, started, None, *usage_tokens(json.loads(answer)))
        return Response(answer, media_type="application/json")

    async def models(self, request: Request) -> Response:
        model = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "loom"}
        if self.config.engine.max_model_len is not None:
            model["max_model_len"] = self.config.engine.max_model_len
        loaded = self.adapters.loaded() if self.adapters is not None else []
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "loom",
                     "parent": self.config.model_name} for name in loaded]
        return JSONResponse({"object": "list", "data": [model, *adapters]})

    async def adapter_states(self, request: Request) -> Response:
        """This replica's adapters and their states (the operator reads them into the service's status)."""
        if self.adapters is None:
            return JSONResponse({"adapters": []})
        return JSONResponse(self.adapters.report())

    # ------------------------------------------------------------------------------------------- OIP v2
    def _served(self, request: Request) -> None:
        name = request.path_params["name"]
        if name != self.config.model_name:
            raise OpenAIError(404, f"model '{name}' is not served here", "model_not_found")

    async def generate(self, request: Request) -> Response:
        self._served(request)
        decoded = decode_generate_request(await request.body())
        body = generate_to_completion(decoded, self.config.model_name, stream=False)
        parsed = parse_request("completion", body, self.config.model_name, self.config.limits.max_tokens_limit)
        doc = await self._complete(request, "/v1/completions", parsed)
        return JSONResponse(completion_to_generate(doc, self.config.model_name, decoded.id).to_dict())

    async def generate_stream(self, request: Request) -> Response:
        self._served(request)
        decoded = decode_generate_request(await request.body())
        body = generate_to_completion(decoded, self.config.model_name, stream=True)
        parsed = parse_request("completion", body, self.config.model_name, self.config.limits.max_tokens_limit)
        chunks, _ = await self._open_stream(request, "/v1/completions", parsed)

        async def pieces() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for block in chunks:
                    answers = [completion_to_generate(doc, self.config.model_name, decoded.id).to_dict()
                               for doc in events(block)]
                    if answers:
                        yield b"".join(sse(answer) for answer in answers)

        return self._sse(pieces(), lambda: b"")  # the generate extension's stream has no [DONE]

    # ------------------------------------------------------------------------------------------- health
    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready_probe(self, request: Request) -> Response:
        ready = self.ready and not self.drain.active and await self.engine.healthy()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def model_ready(self, request: Request) -> Response:
        self._served(request)
        return await self.ready_probe(request)

    async def prometheus(self, request: Request) -> Response:
        text = await self.engine.metrics_text()
        return Response(self.metrics.exposition(text), media_type=CONTENT_TYPE_LATEST)

    async def tokenizer(self, request: Request) -> Response:
        """The tokenizer files as the engine uses them, for the endpoint picker (tokenizer_files.py)."""
        data = await asyncio.to_thread(tokenizer_file, Path(self.config.model_dir), request.path_params["file"],
                                       self.config.engine.chat_template)
        if data is None:
            return error_response(OpenAIError(404, f"the model has no {request.path_params['file']}", "not_found"))
        return Response(data, media_type="application/json")

    async def tokenizer_index(self, request: Request) -> Response:
        """The tokenizer's digest: the picker asks every replica for it now and then (a new model's tokenizer)."""
        found = await asyncio.to_thread(tokenizer_digest, Path(self.config.model_dir), self.config.engine.chat_template)
        if found is None:
            return error_response(OpenAIError(404, "the model has no tokenizer.json", "not_found"))
        return JSONResponse({"digest": found})

    def table(self) -> list[Route]:
        routes = [  # the token path's routes first: Starlette tries each route's pattern in order
            Route("/v1/chat/completions", self.measured("chat_completions", self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self.measured("completions", self.completions), methods=["POST"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready_probe, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route(ADAPTERS_PATH, self.adapter_states, methods=["GET"]),
            Route("/v1/models", self.measured("models", self.models), methods=["GET"]),
            Route("/v1/embeddings", self.measured("embeddings", self.embeddings), methods=["POST"]),
            Route("/v2/models/{name}/ready", self.model_ready, methods=["GET"]),
        ]
        for suffix, handler in (("generate", self.generate), ("generate_stream", self.generate_stream)):
            wrapped = self.measured(suffix, handler)
            routes.append(Route(f"/v2/models/{{name}}/{suffix}", wrapped, methods=["POST"]))
            routes.append(Route(f"/v2/models/{{name}}/versions/{{version}}/{suffix}", wrapped, methods=["POST"]))
        if self.config.engine.kv_events_port is not None:  # the picker's precise prefix routing reads them
            routes.append(Route(TOKENIZER_PATH, self.tokenizer_index, methods=["GET"]))
            routes.append(Route(f"{TOKENIZER_PATH}/{{file}}", self.tokenizer, methods=["GET"]))
        return routes


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(OpenAIError(404, f"no route for {request.method} {request.url.path}", "not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    message = f"method {request.method} not allowed on {request.url.path}"
    return error_response(OpenAIError(405, message, "method_not_allowed"))


def build_app(config: LlmServerConfig, engine: VllmEngine | None = None, drain: Drain | None = None,
              on_engine_failed: Callable[[str], None] | None = None) -> Starlette:
    """The front for one model. The engine starts in the app's lifespan and is stopped when the app stops
    (after the drain: requests in flight finish first); readiness turns true once the engine is healthy.
    ``on_engine_failed`` is told why if the engine never becomes ready (the entry point then exits 1)."""
    drain = drain or Drain()
    engine = engine or VllmEngine(config)
    metrics = LlmMetrics(config.model_name)
    limits = config.limits
    tokens = TokenBudget(limits.tokens_per_minute) if limits.tokens_per_minute else None
    adapters = AdapterManager(config, engine) if config.engine.enable_lora else None
    routes = LlmRoutes(config, engine, metrics, drain, tokens, adapters)

    async def become_ready() -> None:
        try:
            await engine.wait_ready()
        except EngineUnavailable as exc:
            log.error("%s", exc)
            if on_engine_failed is not None:
                on_engine_failed(str(exc))
            return
        if adapters is not None:
            # The adapters named at start are loaded before the replica turns ready (each failure is its own).
            adapters.read_list()
            adapters.step()
            await adapters.settled()
            loops.append(asyncio.create_task(adapters.run()))
        routes.ready = True
        log.info("the vLLM engine is ready: serving %s", config.model_name)

    loops: list[asyncio.Task[None]] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        waiter = asyncio.create_task(become_ready())
        try:
            yield
        finally:
            waiter.cancel()
            for loop in loops:
                loop.cancel()
            if adapters is not None:
                await adapters.stop()
            await engine.stop()

    guard = Middleware(
        LlmGuard, keys=ApiKeys(config.auth), exempt=(ADAPTERS_PATH, *TOKENIZER_PATHS),
        requests=RequestBudget(limits.requests_per_minute) if limits.requests_per_minute else None,
        tokens=tokens, metrics=metrics,
    )
    app = Starlette(
        routes=routes.table(), lifespan=lifespan,
        middleware=[
            Middleware(CloseWhileDraining, drain=drain), guard,
            Middleware(BodyLimit, max_bytes=config.max_request_bytes, timeout_s=config.request_body_timeout_s,
                       error_body=body_limit_error),
        ],
        exception_handlers={404: _not_found, 405: _not_allowed},
    )
    app.state.routes = routes
    app.state.engine = engine
    app.state.adapters = adapters
    return app
