"""API keys and per-key limits for the OpenAI front, as ASGI middleware, reusing the model server's key and
caller code (loom.workloads.server.flow): keys as ``Authorization: Bearer`` (or ``x-api-key``), a request
budget per minute and a token budget per minute (budget.py; tokens charged by the routes once usage is known).
Refusals are OpenAI-shaped. Probes and /metrics are exempt, as on the model server.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from loom.workloads.server.callers import caller_of, guarded, send_json
from loom.workloads.server.flow import ApiKeys, retry_after_header

from .budget import RequestBudget, TokenBudget
from .metrics import LlmMetrics
from .openai_protocol import OpenAIError


class LlmGuard:
    def __init__(self, app: ASGIApp, keys: ApiKeys, requests: RequestBudget | None, tokens: TokenBudget | None,
                 metrics: LlmMetrics, exempt: tuple[str, ...] = ()) -> None:
        self.app, self.keys, self.requests, self.tokens, self.metrics = app, keys, requests, tokens, metrics
        self.exempt = exempt  # paths open like the probes (the adapter states the operator reads: names, no data)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not guarded(scope) or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        caller = caller_of(scope, self.keys)
        if caller is None:
            message = "a valid API key is required (Authorization: Bearer <key>)"
            challenge = {"www-authenticate": "Bearer"}
            await self._reject(send, OpenAIError(401, message, "invalid_api_key", headers=challenge))
            return
        if self.requests is not None:
            wait = self.requests.hit(caller, time.monotonic())
            if wait is not None:
                await self._reject(send, _limited("requests", wait))
                return
        if self.tokens is not None:
            wait = self.tokens.check(caller, time.monotonic())
            if wait is not None:
                await self._reject(send, _limited("tokens", wait))
                return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

    async def _reject(self, send: Send, error: OpenAIError) -> None:
        self.metrics.answered("refused", error.status)
        await send_json(send, error.status, error.body(), error.headers)


def _limited(budget: str, wait: float) -> OpenAIError:
    return OpenAIError(429, f"rate limit reached: {budget} per minute for this key; retry after {wait:.0f} s",
                       "rate_limit_exceeded", headers={"retry-after": retry_after_header(wait)})
