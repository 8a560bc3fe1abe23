"""A small async client for Prometheus' instant-query API (the only I/O of the autoscaler).

Kept apart from the decision and the query builders, which stay pure: the controller asks this
client, hands the samples to `summarize`, and the result to `decide`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import httpx

from .decision import MetricUnavailable, MetricValue
from .promql import MetricQuery
from .samples import PrometheusError, Sample, parse_response, summarize


class PrometheusClient:
    """Instant queries against one Prometheus (base URL such as http://prometheus.monitoring:9090)."""

    def __init__(self, base_url: str, *, timeout: float = 5.0, client: httpx.AsyncClient | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus URL must start with http:// or https://, got {base_url!r}")
        self._url = base_url.rstrip("/") + "/api/v1/query"
        self._timeout = timeout
        self._client = client or httpx.AsyncClient(timeout=timeout)
        self._owned = client is None

    async def aclose(self) -> None:
        if self._owned:
            await self._client.aclose()

    async def __aenter__(self) -> PrometheusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def query(self, expr: str, *, at: float | None = None) -> list[Sample]:
        """Evaluate `expr` at `at` (Unix seconds; default: Prometheus' now)."""
        params = {"query": expr, "timeout": f"{self._timeout:g}s"}
        if at is not None:
            params["time"] = f"{at:.3f}"
        try:
            # POST form: long PromQL (many pod names) stays clear of URL length limits.
            response = await self._client.post(self._url, data=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"Prometheus at {self._url} unreachable: {exc}") from exc
        # Prometheus answers 400/422/503 with its JSON error body: read it for the message.
        try:
            body: Any = response.json()
        except ValueError as exc:
            raise PrometheusError(
                f"Prometheus at {self._url} answered HTTP {response.status_code} without JSON"
            ) from exc
        if not isinstance(body, dict):
            raise PrometheusError(f"Prometheus at {self._url} answered a JSON {type(body).__name__}")
        return parse_response(body)

    async def observe(
        self,
        query: MetricQuery,
        *,
        now: float,
        max_age_seconds: float,
        ready_pods: Collection[str] | None = None,
    ) -> MetricValue | MetricUnavailable:
        """The metric for the decision; a failed query becomes QueryFailed (hold), never an exception."""
        try:
            if query.freshness is None:
                values, freshness = await self.query(query.value, at=now), None
            else:
                values, freshness = await asyncio.gather(
                    self.query(query.value, at=now), self.query(query.freshness, at=now)
                )
        except PrometheusError as exc:
            return MetricUnavailable(reason="QueryFailed", message=str(exc))
        return summarize(
            query, values, freshness, now=now, max_age_seconds=max_age_seconds, ready_pods=ready_pods
        )
