"""The picker's HTTP side: every request, any path and method, sent to the replica the decision picks (decide.py,
the one a gateway's Envoy gets over ext_proc), and its answer streamed back unbuffered (the activator's proxy:
loom.workloads.activator.proxy).

Nothing about keys or limits happens here: headers pass through as they came, and each replica's front checks
API keys, request and token budgets as it does without a picker. Answers of its own (JSON, never a model's):
503 + Retry-After `{"code": "picker_no_replica"}` when no replica can take the request within the wait bound,
413 for a body over the cap, 502 when the replica broke off before answering. A replica that refuses the
connection (going away) got nothing: the request goes to another one. The admin app (its own port) serves
/healthz and /metrics. A disaggregated service's generation request is first prefilled on a prefill replica of the
decode replica's kv-version (prefill_hop.py), then forwarded to the decode replica.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from loom.workloads.activator.app import METHODS, _error, _path, read_body
from loom.workloads.activator.proxy import Unreachable, Upstream, raw_response_headers, relay, request_headers

from .config import PickerConfig
from .decide import Decider, PickRequest, Refused
from .prefill_hop import PrefillHop
from .state import PickerState

log = logging.getLogger("loom.workloads.picker")

# A request that finds no replica waits this long for one (a rollout's or a scale-down's gap) before its 503.
NO_REPLICA_WAIT_S = 10.0


def build_app(config: PickerConfig, state: PickerState, upstream: Upstream,
              no_replica_wait_s: float = NO_REPLICA_WAIT_S, decider: Decider | None = None) -> Starlette:
    """The proxy; `decider`: the decision it asks (default: one over `state` waiting `no_replica_wait_s` for a
    replica)."""
    decider = decider or Decider(state, wait_s=no_replica_wait_s)
    metrics = state.metrics
    disaggregation = config.disaggregation
    prefill = PrefillHop(state, upstream, disaggregation.prefill_timeout_seconds) if disaggregation else None

    async def forward(request: Request) -> Response:
        body = await read_body(request, config.max_body_bytes, metrics.outcome, "picker_too_large")
        if isinstance(body, Response):
            return body
        headers = request_headers(request.headers.items(), request.client.host if request.client else None)
        path = _path(request)
        tried: frozenset[str] = frozenset()
        prefilled = prefill is None
        while True:
            outcome = await decider.decide(PickRequest(request.url.path, body, request.headers, exclude=tried))
            if isinstance(outcome, Refused):
                retry = {"Retry-After": str(outcome.retry_after_s)} if outcome.retry_after_s is not None else {}
                return _error(outcome.status, outcome.message, outcome.code, retry)
            endpoint = outcome.endpoint
            if prefill is not None and not prefilled:  # once: a retry's decode replica loads it or prefills
                prefilled = True
                try:
                    await prefill.before_decode(request.url.path, path, body, headers, request.headers, endpoint)
                except BaseException:
                    decider.finished(outcome)  # the client left during the prefill hop
                    raise
            try:
                response = await upstream.send(endpoint, request.method, path, headers, body)
            except Unreachable as exc:
                decider.finished(outcome)
                log.info("replica unreachable (%s); trying another", exc)
                metrics.outcome("retried")
                state.forget(endpoint)
                tried = tried | {endpoint}
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                decider.finished(outcome)
                metrics.outcome("upstream_error")
                return _error(502, f"the replica broke off: {type(exc).__name__}", "picker_upstream")
            break
        metrics.outcome("forwarded")
        routed = outcome

        async def body_then_done() -> AsyncIterator[bytes]:
            try:
                async for chunk in relay(response):
                    yield chunk
            finally:
                decider.finished(routed)

        answer = StreamingResponse(body_then_done(), status_code=response.status)
        answer.raw_headers = raw_response_headers(response.headers.items())
        return answer

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await upstream.aclose()

    routes = [Route("/", forward, methods=METHODS), Route("/{path:path}", forward, methods=METHODS)]
    return Starlette(routes=routes, lifespan=lifespan)


def build_admin_app(state: PickerState, ready: Callable[[], bool],
                    active: Callable[[], bool] = lambda: True) -> Starlette:
    """/healthz (200 once the first pod list arrived: the kubelet's liveness probe), /readyz (besides, this pod is
    the one serving: its readiness probe, so a standby (`active` false) is never the Service's endpoint) and
    /metrics."""

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok") if ready() else PlainTextResponse("pods not listed yet", status_code=503)

    async def readyz(request: Request) -> Response:
        if not ready():
            return PlainTextResponse("pods not listed yet", status_code=503)
        return PlainTextResponse("ok") if active() else PlainTextResponse("standby", status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", prometheus)])
