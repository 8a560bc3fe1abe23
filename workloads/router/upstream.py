"""Calls to the graph's InferenceServices over pooled HTTP/1.1 connections.

One aiohttp ``ClientSession`` (with its own ``TCPConnector`` pool) per service, kept for the
router's life, so a step reuses a warm keep-alive connection instead of paying a TCP handshake. Bodies are sent as the
bytes they are. The caller's API key and trace context are forwarded (see :func:`forwarded_headers`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from yarl import URL

from .config import UpstreamConfig
from .payload import Payload

# Headers passed from the graph's caller to every step, as they are (traceparent gets a new span id).
FORWARDED = ("authorization", "x-api-key", "tracestate", "x-request-id", "baggage")
_HEX = frozenset("0123456789abcdef")


class UpstreamFailure(Exception):
    """A service answered with an error status, or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass
class Stream:
    """A step's event stream: the first chunk (already read, so an error event before any data is
    still a proper error status) and the rest, passed on as they arrive."""

    first: bytes
    rest: AsyncIterator[bytes]
    response: aiohttp.ClientResponse | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self.first:
                yield self.first
            async for chunk in self.rest:
                yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        # Back to the pool when the stream was read to its end; a stream broken off closes its connection.
        if self.response is not None:
            self.response.release()


class Caller(Protocol):
    """What the graph engine needs from the network (a fake in pure tests).

    Both raise :class:`UpstreamFailure` for an error answer or an unreachable service and
    ``TimeoutError`` when a timeout of the transport passed; ``stream`` returns once the first chunk
    has arrived.
    """

    async def call(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Payload: ...

    async def stream(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Stream: ...


def _valid_traceparent(value: str) -> tuple[str, str] | None:
    """(trace id, flags) of a W3C traceparent version 00, or None when it is malformed."""
    parts = value.strip().split("-")
    if len(parts) < 4 or parts[0] == "ff" or len(parts[0]) != 2:
        return None
    trace_id, parent_id, flags = parts[1], parts[2], parts[3]
    if len(trace_id) != 32 or len(parent_id) != 16 or len(flags) != 2:
        return None
    if not set(trace_id + parent_id + flags) <= _HEX or trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id, flags


def child_traceparent(incoming: str | None) -> str:
    """A traceparent for one step: the caller's trace id and flags with a new span id, or a new trace."""
    parsed = _valid_traceparent(incoming) if incoming else None
    trace_id, flags = parsed if parsed else (secrets.token_hex(16), "00")
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


def forwarded_headers(incoming: Mapping[str, str]) -> dict[str, str]:
    """The headers every step of one request gets (``traceparent`` is added per step)."""
    headers = {name: incoming[name] for name in FORWARDED if name in incoming}
    # Without a valid caller context the request starts its own trace, shared by all of its steps.
    caller = incoming.get("traceparent")
    headers["traceparent"] = caller if caller and _valid_traceparent(caller) else child_traceparent(None)
    return headers


def _message(response_body: bytes) -> str:
    """The error message of an upstream answer: its ``{"error": ...}`` or the start of its text."""
    with contextlib.suppress(ValueError):
        doc = json.loads(response_body)
        if isinstance(doc, dict) and "error" in doc:
            value = doc["error"]
            if isinstance(value, dict) and isinstance(value.get("message"), str):  # OpenAI's shape
                return str(value["message"])
            return value if isinstance(value, str) else json.dumps(value)
    return response_body[:500].decode("utf-8", "replace").strip() or "(empty body)"


def _is_error_event(chunk: bytes) -> bool:
    return chunk.lstrip().startswith(b'data: {"error"')


class Upstreams:
    """One aiohttp connection pool (HTTP/1.1 keep-alive) per service; implements :class:`Caller`.

    aiohttp rather than httpx: against the same server its client costs about a quarter of the CPU
    per call (httpx's pool locking and connection checks dominated the router's hop). URLs are built
    once at start-up. The sessions are opened on first use, on the loop that serves the requests
    (an aiohttp session belongs to one running loop; the app is built before uvicorn starts it).
    """

    # Endpoint -> path under the service's URL ({model}: its served model name). chat: the OpenAI chat API of a
    # runtime vllm service (steps with protocol openai-chat), where the model is named in the body instead.
    ENDPOINTS = {
        "infer": "/v2/models/{model}/infer",
        "generate": "/v2/models/{model}/generate",
        "generate_stream": "/v2/models/{model}/generate_stream",
        "chat": "/v1/chat/completions",
    }
    # Below the servers' 6 s drain window (and far below their 75 s keep-alive): a connection the server is about
    # to close is not reused (a POST that meets a closing connection fails and is not retried).
    KEEPALIVE_S = 4.0

    def __init__(self, services: Mapping[str, UpstreamConfig], timeout_s: float, max_connections: int = 100):
        self._names = list(services)
        self._max_connections = max_connections
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._urls = {
            (name, endpoint): URL(cfg.url + path.format(model=cfg.model_name))
            for name, cfg in services.items()
            for endpoint, path in self.ENDPOINTS.items()
        }
        # The engine bounds each call with its step timeout and the graph deadline; this one (the
        # longest step timeout) bounds connecting (waiting for a pooled connection included) and the
        # reads between the chunks of a stream. No total: a stream may last as long as it keeps talking.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)

    def _session(self, service: str) -> aiohttp.ClientSession:
        session = self._sessions.get(service)
        if session is None:
            if service not in self._names:
                raise KeyError(service)
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=self.KEEPALIVE_S
            )
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                # Never keep an upstream's cookies: they would reach every later caller's steps.
                cookie_jar=aiohttp.DummyCookieJar(),
                # Only what the caller sent and the body's framing: no compression to negotiate.
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
            self._sessions[service] = session
        return session

    async def _post(
        self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        merged = {**headers, **payload.http_headers()}
        merged["traceparent"] = child_traceparent(headers.get("traceparent"))
        return await self._session(service).post(self._urls[(service, endpoint)], data=payload.body, headers=merged)

    async def call(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Payload:
        try:
            response = await self._post(service, endpoint, payload, headers)
            try:
                body = await response.read()
            finally:
                response.release()
        except TimeoutError as exc:
            raise TimeoutError(f"{service}: {type(exc).__name__}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamFailure(None, f"cannot reach {service}: {type(exc).__name__}: {exc}") from exc
        if response.status != 200:
            raise UpstreamFailure(response.status, _message(body), _retry(response.headers))
        return Payload.from_http(body, response.headers, "response")

    async def stream(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Stream:
        try:
            response = await self._post(service, endpoint, payload, headers)
        except TimeoutError as exc:
            raise TimeoutError(f"{service}: {type(exc).__name__}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamFailure(None, f"cannot reach {service}: {type(exc).__name__}: {exc}") from exc
        try:
            if response.status != 200:
                body = await response.read()
                raise UpstreamFailure(response.status, _message(body), _retry(response.headers))
            chunks = response.content.iter_any()
            first = b""
            async for chunk in chunks:
                if chunk:
                    first = chunk
                    break
            if _is_error_event(first):
                line = first.lstrip()[len(b"data: ") :].split(b"\n", 1)[0]
                raise UpstreamFailure(200, _message(line))
        except TimeoutError as exc:
            response.close()
            raise TimeoutError(f"{service}: {type(exc).__name__}") from exc
        except aiohttp.ClientError as exc:
            response.close()
            raise UpstreamFailure(None, f"{service} broke off: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            response.close()
            raise
        return Stream(first, chunks, response)

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


def _retry(headers: Mapping[str, str]) -> dict[str, str]:
    value = headers.get("retry-after")
    return {"retry-after": value} if value else {}
