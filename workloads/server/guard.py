"""ASGI middleware in front of the model endpoints: API keys, rate limits, error accounting.

Probes and metrics are exempt: the kubelet and Prometheus carry no API key, and a rate-limited
readiness probe would take a healthy replica out of its Service.
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from .flow import ANONYMOUS, ApiKeys, RateLimiter, presented_key, retry_after_header
from .metrics import ServerMetrics

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/v2/health/", "/metrics")


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, keys: ApiKeys, limiter: RateLimiter | None, metrics: ServerMetrics
    ) -> None:
        self.app = app
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXEMPT_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        caller = ANONYMOUS
        if self.keys.enabled:
            key = presented_key(headers.get("authorization"), headers.get("x-api-key"))
            checked = self.keys.check(key)
            if checked is None:
                # Log that a key was refused, never the key itself.
                log.info("refused request to %s: %s", scope["path"], "no API key" if key is None else "bad API key")
                await self._reject(send, 401, "a valid API key is required", {"www-authenticate": "Bearer"})
                return
            caller = checked
        elif scope.get("client"):
            caller = f"client-{scope['client'][0]}"
        if self.limiter is not None:
            wait = self.limiter.hit(caller)
            if wait is not None:
                await self._reject(
                    send, 429, "rate limit exceeded", {"retry-after": retry_after_header(wait)}
                )
                return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

    async def _reject(self, send: Send, status: int, message: str, extra: dict[str, str]) -> None:
        self.metrics.errors.labels(self.metrics.model, str(status)).inc()
        body = json.dumps({"error": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
