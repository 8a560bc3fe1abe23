"""The kubelet endpoint the API server proxies `kubectl logs` to: GET /containerLogs/{ns}/{pod}/{container}.

Served over HTTPS with the kubelet serving certificate; supports tailLines, previous, limitBytes
and follow (streams new output until the container attempt ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

# (namespace, pod, container, previous) -> (log file, is that attempt still running)
LogLocator = Callable[[str, str, str, bool], tuple[Path, Callable[[], bool]] | None]


def tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


class LogServer:
    def __init__(self, locate: LogLocator, port: int, cert: str | None, key: str | None) -> None:
        self.locate, self.port, self.cert, self.key = locate, port, cert, key
        self.runner: web.AppRunner | None = None
        self.started = False

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self.container_logs)
        app.router.add_get("/healthz", self.healthz)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        context = None
        if self.cert and self.key:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.cert, self.key)
        # reuse_port: an agent taking over serves beside the old one until that one leaves.
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=context, reuse_port=True).start()
        # The Node's Hostname address is `localhost`, which a client may try as ::1 first.
        with contextlib.suppress(OSError):
            await web.TCPSite(self.runner, "::1", self.port, ssl_context=context, reuse_port=True).start()
        self.started = True

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        query = request.query
        previous = query.get("previous", "false") == "true"
        found = self.locate(info["namespace"], info["pod"], info["container"], previous)
        if found is None:
            what = "previous terminated container" if previous else "container"
            raise web.HTTPNotFound(text=f'{what} "{info["container"]}" in pod "{info["pod"]}" not found')
        path, alive = found
        data = path.read_bytes() if path.exists() else b""
        if "tailLines" in query:
            data = tail(data, int(query["tailLines"]))
        if "limitBytes" in query:
            data = data[: int(query["limitBytes"])]
        if query.get("follow", "false") != "true":
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        offset = path.stat().st_size if path.exists() else 0
        while True:
            running = alive()
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                offset += len(chunk)
                await response.write(chunk)
            elif not running:
                break
            else:
                await asyncio.sleep(0.3)
        await response.write_eof()
        return response
