"""Graceful shutdown: what SIGTERM does to a serving replica (the model server and the InferenceGraph router,
both Starlette apps under uvicorn, share it).

Kubernetes takes a terminating pod out of its Service's endpoints while it runs the preStop hook and
then sends SIGTERM; proxies and clients may learn of the removal a little later, and clients holding a
keep-alive connection keep using it. So on SIGTERM the server

1. reports not ready at once (``/v2/health/ready`` and model readiness answer 503) but keeps serving for
   ``drain_seconds``, answering every response with ``Connection: close`` so that keep-alive clients
   reconnect, through the Service, to a replica that stays;
2. then stops accepting (uvicorn's graceful shutdown): idle connections close, requests and streams in
   flight finish, for at most ``timeout_seconds`` (the rest of the pod's grace period);
3. then the app's lifespan ends (the server's data plane stops, the router's upstream pools close) and the
   process exits 0.

A second SIGTERM ends the drain window early (still graceful); SIGINT keeps uvicorn's own behaviour.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    """`--drain-seconds` and `--shutdown-timeout`, as the operator renders them for both servers."""
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=1.0,
        help="after SIGTERM, keep serving this long (not ready, closing keep-alive) before refusing new connections",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="then wait at most this long for requests in flight (default: until they finish)",
    )


def check_drain_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.drain_seconds < 0 or (args.shutdown_timeout is not None and args.shutdown_timeout < 0):
        parser.error("--drain-seconds and --shutdown-timeout must be >= 0")


class Drain:
    """Whether the server is draining, and until when it keeps accepting."""

    def __init__(self, seconds: float = 0.0) -> None:
        if seconds < 0:
            raise ValueError(f"drain seconds must be >= 0, got {seconds}")
        self.seconds = seconds
        self.started: float | None = None

    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def over(self) -> bool:
        """True once the drain window has passed: time to stop accepting."""
        return self.started is not None and time.monotonic() - self.started >= self.seconds


class CloseWhileDraining:
    """ASGI middleware: while draining, every response carries ``Connection: close`` (uvicorn then closes the
    connection after it), so no new request arrives on a kept-alive connection to a replica going away."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.drain.active:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a drain window between SIGTERM and its graceful shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: only flags here (on_tick, on the event loop, acts and logs).
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif self.drain.active:
            self.should_exit = True  # asked again: skip the rest of the window
        else:
            self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.active and not self._announced:
            self._announced = True
            log.info(
                "SIGTERM: draining (not ready, closing keep-alive) for %gs, then finishing requests in flight",
                self.drain.seconds,
            )
        if self.drain.over():
            self.should_exit = True
        return await super().on_tick(counter)
