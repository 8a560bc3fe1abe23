"""Prometheus HTTP API answers, parsed and summarised into what the decision reads (pure).

`parse_response` turns an /api/v1/query body into samples; `summarize` turns the samples of a
`MetricQuery` (its value and freshness answers) into a `MetricValue`, or a `MetricUnavailable` saying
why there is nothing to act on: no sample for any ready pod (missing) or only samples older than the
allowed age (stale).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from .decision import MetricUnavailable, MetricValue
from .promql import MetricQuery


class PrometheusError(RuntimeError):
    """Prometheus answered with an error, or with something that is not a query result."""


class Sample(BaseModel):
    model_config = ConfigDict(frozen=True)

    labels: dict[str, str]
    value: float  # may be NaN or +-Inf, as PromQL can produce them
    timestamp: float

    @property
    def pod(self) -> str | None:
        return self.labels.get("pod")


class _Series(BaseModel):
    metric: dict[str, str]
    value: tuple[float, str]


class _Data(BaseModel):
    resultType: Literal["vector", "scalar", "matrix", "string"]  # the API's own names
    result: Any


class _Response(BaseModel):
    status: Literal["success", "error"]
    data: _Data | None = None
    errorType: str | None = None
    error: str | None = None


def parse_response(body: Mapping[str, Any]) -> list[Sample]:
    """Samples of an instant query's answer (a vector, or a scalar as one unlabelled sample)."""
    try:
        response = _Response.model_validate(body)
    except ValidationError as exc:
        raise PrometheusError(f"not a Prometheus query response: {exc.errors()[0]['msg']}") from exc
    if response.status == "error":
        raise PrometheusError(f"Prometheus: {response.errorType or 'error'}: {response.error or 'no message'}")
    if response.data is None:
        raise PrometheusError("Prometheus answered success without data")
    kind, result = response.data.resultType, response.data.result
    try:
        if kind == "vector":
            series = [_Series.model_validate(item) for item in result]
            return [Sample(labels=s.metric, value=_number(s.value[1]), timestamp=s.value[0]) for s in series]
        if kind == "scalar":
            at, text = result
            return [Sample(labels={}, value=_number(text), timestamp=float(at))]
    except (ValidationError, TypeError, ValueError) as exc:
        raise PrometheusError(f"malformed {kind} result: {exc}") from exc
    raise PrometheusError(f"expected an instant vector or scalar, got a {kind}")


def _number(text: str) -> float:
    # Prometheus writes NaN, +Inf and -Inf as strings; float() reads all three.
    return float(text)


def summarize(
    query: MetricQuery,
    values: list[Sample],
    freshness: list[Sample] | None,
    *,
    now: float,
    max_age_seconds: float,
    ready_pods: Collection[str] | None = None,
) -> MetricValue | MetricUnavailable:
    """The metric the decision acts on. ready_pods: only these pods count (None: every pod answered)."""
    if query.scope == "workload":
        return _workload(query, values, now=now, max_age_seconds=max_age_seconds)
    per_pod: dict[str, float] = {}
    for s in values:
        if s.pod is not None and math.isfinite(s.value) and (ready_pods is None or s.pod in ready_pods):
            per_pod[s.pod] = s.value
    # When each pod's samples were taken; without a freshness answer, the evaluation time (best known).
    taken = {s.pod: s.timestamp for s in values if s.pod is not None}
    for s in freshness or ():
        if s.pod is not None and math.isfinite(s.value):
            taken[s.pod] = s.value
    who = f"{len(ready_pods)} ready pod(s)" if ready_pods is not None else "the workload's pods"
    if not per_pod:
        return MetricUnavailable(reason="MetricMissing", message=f"no {query.kind} sample for {who}")
    fresh = {pod: v for pod, v in per_pod.items() if now - taken[pod] <= max_age_seconds}
    if not fresh:
        newest = max(taken[pod] for pod in per_pod)
        return MetricUnavailable(
            reason="MetricStale",
            message=f"newest {query.kind} sample is {now - newest:.0f}s old (more than {max_age_seconds:g}s)",
            timestamp=newest,
        )
    average = sum(fresh.values()) / len(fresh)
    if average < 0:
        return MetricUnavailable(reason="MetricMissing", message=f"{query.kind} is negative ({average:g})")
    return MetricValue(value=average, timestamp=min(taken[p] for p in fresh), scope="per-pod", pods=len(fresh))


def _workload(
    query: MetricQuery, values: list[Sample], *, now: float, max_age_seconds: float
) -> MetricValue | MetricUnavailable:
    finite = [s for s in values if math.isfinite(s.value)]
    if not finite:
        return MetricUnavailable(reason="MetricMissing", message=f"the {query.kind} query returned no number")
    at = min(s.timestamp for s in finite)
    if now - at > max_age_seconds:
        # Only the evaluation time is known here: this catches a Prometheus answering from the past.
        return MetricUnavailable(
            reason="MetricStale", message=f"the {query.kind} query answered for {now - at:.0f}s ago", timestamp=at
        )
    total = sum(s.value for s in finite)
    if total < 0:
        return MetricUnavailable(reason="MetricMissing", message=f"the {query.kind} query is negative ({total:g})")
    return MetricValue(value=total, timestamp=at, scope="workload")
