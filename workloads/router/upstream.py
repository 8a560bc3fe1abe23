"""Calls to the graph's InferenceServices over pooled HTTP/1.1 connections.

One ``httpx.AsyncClient`` per service, created at start-up and kept for the router's life, so a
step reuses a warm keep-alive connection instead of paying a TCP handshake. Bodies are sent as the
bytes they are. The caller's API key and trace context are forwarded (see :func:`forwarded_headers`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx

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
    response: httpx.Response | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self.first:
                yield self.first
            async for chunk in self.rest:
                yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self.response is not None:
            await self.response.aclose()


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
            return value if isinstance(value, str) else json.dumps(value)
    return response_body[:500].decode("utf-8", "replace").strip() or "(empty body)"


def _is_error_event(chunk: bytes) -> bool:
    return chunk.lstrip().startswith(b'data: {"error"')


class Upstreams:
    """One pooled HTTP/1.1 connection pool per service; implements :class:`Caller`.

    Requests go straight to an ``httpx.AsyncHTTPTransport`` with URLs built once at start-up: the
    ``AsyncClient`` layer (base-URL merging, cookies, redirects, auth) is skipped because the router
    needs none of it and it costs more than the rest of the hop.
    """

    ENDPOINTS = ("infer", "generate", "generate_stream")

    def __init__(
        self,
        services: Mapping[str, UpstreamConfig],
        timeout_s: float,
        max_connections: int = 100,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._transports: dict[str, httpx.AsyncBaseTransport] = {
            name: transport or httpx.AsyncHTTPTransport(http1=True, http2=False, limits=limits) for name in services
        }
        self._urls = {
            (name, endpoint): httpx.URL(f"{cfg.url}/v2/models/{cfg.model_name}/{endpoint}")
            for name, cfg in services.items()
            for endpoint in self.ENDPOINTS
        }
        # The engine bounds each call with its step timeout and the graph deadline; this one (the
        # longest step timeout) bounds connecting and the reads between the chunks of a stream.
        self._timeout = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}

    async def _send(
        self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]
    ) -> httpx.Response:
        merged = {**headers, **payload.http_headers()}
        merged["traceparent"] = child_traceparent(headers.get("traceparent"))
        request = httpx.Request(
            "POST", self._urls[(service, endpoint)], content=payload.body, headers=merged,
            extensions={"timeout": self._timeout},
        )
        response = await self._transports[service].handle_async_request(request)
        response.request = request
        return response

    async def call(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Payload:
        try:
            response = await self._send(service, endpoint, payload, headers)
            try:
                body = await response.aread()
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{service}: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamFailure(None, f"cannot reach {service}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise UpstreamFailure(response.status_code, _message(body), _retry(response))
        return Payload.from_http(body, response.headers, "response")

    async def stream(self, service: str, endpoint: str, payload: Payload, headers: Mapping[str, str]) -> Stream:
        try:
            response = await self._send(service, endpoint, payload, headers)
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{service}: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamFailure(None, f"cannot reach {service}: {type(exc).__name__}: {exc}") from exc
        try:
            if response.status_code != 200:
                body = await response.aread()
                raise UpstreamFailure(response.status_code, _message(body), _retry(response))
            chunks = response.aiter_bytes()
            first = b""
            async for chunk in chunks:
                if chunk:
                    first = chunk
                    break
            if _is_error_event(first):
                line = first.lstrip()[len(b"data: ") :].split(b"\n", 1)[0]
                raise UpstreamFailure(200, _message(line))
        except httpx.TimeoutException as exc:
            await response.aclose()
            raise TimeoutError(f"{service}: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            await response.aclose()
            raise UpstreamFailure(None, f"{service} broke off: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            await response.aclose()
            raise
        return Stream(first, chunks, response)

    async def aclose(self) -> None:
        for transport in set(self._transports.values()):
            await transport.aclose()


def _retry(response: httpx.Response) -> dict[str, str]:
    value = response.headers.get("retry-after")
    return {"retry-after": value} if value else {}
