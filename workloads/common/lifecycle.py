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

Kept-alive connections are also why both servers keep an idle connection open much longer than clients keep
theirs (``KEEP_ALIVE_SECONDS``, see ``uvicorn_config``).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# The drain window: longer than clients' idle keep-alive expiry (httpx: 5 s), so by its end every kept-alive
# connection was either used once more (answered with Connection: close) or dropped by its client. Closing an
# idle connection first races with a request the client sends on it, which is lost ("server disconnected
# without sending a response"; the chaos serving load lost 7 in 3,100 requests through a rollout, a promotion
# and a scale-down with 1 s). The operator renders the same value for the server and the router.
DRAIN_SECONDS = 6.0
# How long an idle kept-alive connection stays open (uvicorn's default: 5 s, exactly httpx's idle expiry). In
# steady state the side that closes an idle connection must be the client: a server that closes it at the moment
# the client reuses it loses that request. So it is well above the idle pools of common clients (httpx 5 s,
# aiohttp 15 s, the router's own 4 s), as load balancers advise for their backends. A client that keeps idle
# connections longer still (Go's net/http: 90 s) can meet the race, rarely.
KEEP_ALIVE_SECONDS = 75


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    """`--drain-seconds` and `--shutdown-timeout`, as the operator renders them for both servers."""
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=DRAIN_SECONDS,
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


def uvicorn_config(
    app: ASGIApp, host: str, port: int, log_level: str, shutdown_timeout: float | None
) -> uvicorn.Config:
    """The uvicorn settings both servers run with: idle connections kept KEEP_ALIVE_SECONDS, no access log (the
    servers count requests in their metrics), and at most `shutdown_timeout` for requests in flight after SIGTERM."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        # uvicorn declares whole seconds; rounding up never cuts a request's time short.
        timeout_graceful_shutdown=None if shutdown_timeout is None else math.ceil(shutdown_timeout),
    )


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
