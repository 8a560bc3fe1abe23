"""ASGI middleware in front of the model endpoints: API keys, rate limits, error accounting (who calls, and which
requests are exempt: callers.py)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from .callers import caller_of, guarded, send_json
from .flow import ApiKeys, RateLimiter, retry_after_header
from .metrics import ServerMetrics


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, keys: ApiKeys, limiter: RateLimiter | None, metrics: ServerMetrics
    ) -> None:
        self.app = app
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not guarded(scope):
            await self.app(scope, receive, send)
            return
        caller = caller_of(scope, self.keys)
        if caller is None:
            await self._reject(send, 401, "a valid API key is required", {"www-authenticate": "Bearer"})
            return
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
        await send_json(send, status, {"error": message}, extra)
