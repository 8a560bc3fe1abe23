"""ASGI middleware bounding what one request body may cost: its size and how long it takes to arrive.

Without it a server buffers any body whole (`await request.body()`): one client sending gigabytes, or many
sending a few bytes a minute, holds memory and connections for as long as it likes. Here a body is read before the
app sees it, up to `max_bytes` and within `timeout_s`: a declared Content-Length over the limit is refused at once
(413) without reading anything, a streamed body (no length) at the first chunk past it (413), and a body that has
not fully arrived in time gets a 408. The app then gets the body it would have read anyway, in one piece.
Each app answers these in its own error shape (`error_body`): the model server's `{"error": "..."}`, the
OpenAI front's `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the configs import the defaults below: the operator has no starlette
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# After the deadline, how long what is already on its way may still take (see BodyLimit.__call__).
_CATCH_UP_S = 0.5
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
# (HTTP status, message) -> the JSON body of the refusal.
ErrorBody = Callable[[int, str], bytes]


def plain_error_body(status: int, message: str) -> bytes:
    """The model server's and the router's error shape."""
    return json.dumps({"error": message}).encode()


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S, error_body: ErrorBody = plain_error_body) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODILESS:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await self._answer(send, 400, "Content-Length must be an integer")
                return
            if length > self.max_bytes:
                await self._answer(send, 413, f"request body of {length} bytes exceeds the limit of {self.max_bytes}")
                return
        chunks: list[bytes] = []
        size = 0
        # The deadline, then one short look more: a server whose event loop was held up elsewhere (a huge body being
        # parsed, a starved CPU) wakes past the deadline with the body already in its buffers. That client was not
        # slow, so what arrived by then still counts; the look starts after the loop caught up.
        for allowed in (self.timeout_s, min(_CATCH_UP_S, self.timeout_s)):
            try:
                async with asyncio.timeout(allowed):
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return  # the client left: nobody to answer
                        chunk = message.get("body", b"")
                        size += len(chunk)
                        if size > self.max_bytes:
                            await self._answer(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                            return
                        chunks.append(chunk)
                        if not message.get("more_body", False):
                            break
                break
            except TimeoutError:
                continue
        else:
            await self._answer(send, 408, f"request body not received within {self.timeout_s:g} s")
            return
        body = b"".join(chunks)
        chunks.clear()
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them

        await self.app(scope, replay, send)

    async def _answer(self, send: Send, status: int, message: str) -> None:
        # The body was not read to its end: close the connection rather than parse the rest as the next request.
        payload = self.error_body(status, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
