"""The front's streamed answer: its pieces written as they come, and the stream stopped when the client leaves.

Starlette's StreamingResponse does the same under uvicorn (ASGI spec 2.3: a server's send() does not fail for a
client that left, so the app must listen for http.disconnect beside the stream), but through an anyio task group
whose task naming and cancel scopes were about half of the front's own time per streamed request
(bench/bench_front_path.py). Here the same two things are two plain asyncio tasks: the stream, and the listener.
When the client leaves, the stream is cancelled: the engine's connection is closed (engine.py), so the engine stops
generating for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class SseResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterable[bytes], headers: Mapping[str, str] | None = None) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for piece in self.body_iterator:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        streaming = loop.create_task(self._stream(send))
        listening = loop.create_task(_until_disconnect(receive))
        try:
            await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The one still running: the listener once the stream is sent; the stream once its client has left (or
            # when this request itself is cancelled, at the server's shutdown).
            for task in (streaming, listening):
                task.cancel()
            await asyncio.wait((streaming, listening))
        if not streaming.cancelled() and (error := streaming.exception()) is not None:
            raise error


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
