"""Prometheus answers parsed and summarised (missing, stale, per pod, workload), and the async client."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loom.operator.autoscale.decision import MetricUnavailable, MetricValue
from loom.operator.autoscale.prometheus import PrometheusClient
from loom.operator.autoscale.promql import PodSelector, build_query
from loom.operator.autoscale.samples import PrometheusError, Sample, parse_response, summarize

NOW = 1_700_000_000.0
PODS = PodSelector.for_pods("ns", ["a", "b", "c"])
QUERY = build_query("gpu-utilization", PODS)


def vector(*series: tuple[dict[str, str], float | str], at: float = NOW) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {"resultType": "vector", "result": [{"metric": m, "value": [at, str(v)]} for m, v in series]},
    }


def samples(*series: tuple[str, float], at: float = NOW) -> list[Sample]:
    return [Sample(labels={"pod": pod}, value=v, timestamp=at) for pod, v in series]


def test_parse_vector_scalar_and_special_values() -> None:
    parsed = parse_response(vector(({"pod": "a", "namespace": "ns"}, 71.5), ({"pod": "b"}, "NaN"), ({}, "+Inf")))
    assert [(s.pod, s.labels.get("namespace"), s.timestamp) for s in parsed] == [
        ("a", "ns", NOW), ("b", None, NOW), (None, None, NOW)
    ]
    assert parsed[0].value == 71.5
    assert parsed[1].value != parsed[1].value  # NaN
    assert parsed[2].value == float("inf")
    scalar = parse_response({"status": "success", "data": {"resultType": "scalar", "result": [NOW, "3"]}})
    assert [(s.labels, s.value) for s in scalar] == [({}, 3.0)]
    assert parse_response(vector()) == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}, "bad_data: parse error"),
        ({"status": "success", "data": {"resultType": "matrix", "result": []}}, "got a matrix"),
        ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}}, "malformed vector"),
        ({"status": "success"}, "without data"),
        ({"hello": "world"}, "not a Prometheus query response"),
    ],
)
def test_parse_rejects_errors_and_garbage_clearly(body: dict[str, Any], message: str) -> None:
    with pytest.raises(PrometheusError, match=message):
        parse_response(body)


def test_summarize_averages_fresh_ready_pods() -> None:
    values = samples(("a", 80.0), ("b", 40.0), ("c", 99.0), ("stranger", 1.0))
    fresh = samples(("a", NOW - 5), ("b", NOW - 10), ("c", NOW - 3))
    m = summarize(QUERY, values, fresh, now=NOW, max_age_seconds=60, ready_pods={"a", "b", "x"})
    assert m == MetricValue(value=60.0, timestamp=NOW - 10, scope="per-pod", pods=2)


def test_summarize_drops_stale_pods_and_reports_all_stale() -> None:
    values = samples(("a", 80.0), ("b", 40.0))
    some_stale = samples(("a", NOW - 5), ("b", NOW - 300))
    m = summarize(QUERY, values, some_stale, now=NOW, max_age_seconds=60)
    assert isinstance(m, MetricValue) and (m.value, m.pods) == (80.0, 1)  # b counts as missing
    all_stale = samples(("a", NOW - 200), ("b", NOW - 300))
    m = summarize(QUERY, values, all_stale, now=NOW, max_age_seconds=60)
    assert isinstance(m, MetricUnavailable)
    assert (m.reason, m.timestamp) == ("MetricStale", NOW - 200)
    assert "200s old" in m.message


def test_summarize_missing() -> None:
    m = summarize(QUERY, [], [], now=NOW, max_age_seconds=60, ready_pods={"a"})
    assert isinstance(m, MetricUnavailable) and m.reason == "MetricMissing"
    assert "gpu-utilization" in m.message and "1 ready pod" in m.message
    only_nan = samples(("a", float("nan")))
    assert isinstance(summarize(QUERY, only_nan, None, now=NOW, max_age_seconds=60), MetricUnavailable)
    unlabelled = [Sample(labels={}, value=5.0, timestamp=NOW)]
    assert isinstance(summarize(QUERY, unlabelled, None, now=NOW, max_age_seconds=60), MetricUnavailable)


def test_summarize_without_freshness_uses_the_evaluation_time() -> None:
    m = summarize(QUERY, samples(("a", 10.0), at=NOW - 2), None, now=NOW, max_age_seconds=60)
    assert isinstance(m, MetricValue) and m.timestamp == NOW - 2


def test_summarize_workload_query_sums_series() -> None:
    q = build_query("prometheus", PODS, promql="my_queue")
    values = [Sample(labels={"x": "1"}, value=3.0, timestamp=NOW), Sample(labels={"x": "2"}, value=4.5, timestamp=NOW)]
    assert summarize(q, values, None, now=NOW, max_age_seconds=60) == MetricValue(
        value=7.5, timestamp=NOW, scope="workload"
    )
    old = [Sample(labels={}, value=3.0, timestamp=NOW - 100)]
    stale = summarize(q, old, None, now=NOW, max_age_seconds=60)
    assert isinstance(stale, MetricUnavailable) and stale.reason == "MetricStale"
    negative = summarize(q, [Sample(labels={}, value=-1.0, timestamp=NOW)], None, now=NOW, max_age_seconds=60)
    assert isinstance(negative, MetricUnavailable) and "negative" in negative.message
    assert isinstance(summarize(q, [], None, now=NOW, max_age_seconds=60), MetricUnavailable)


def _prometheus(answers: dict[str, dict[str, Any]], seen: list[dict[str, str]]) -> httpx.AsyncClient:
    """A fake Prometheus answering by query text (exact), as the real API does: form POST to /api/v1/query."""

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/prom/api/v1/query" and request.method == "POST"
        form = dict(httpx.QueryParams(request.content.decode()))
        seen.append(form)
        if form["query"] not in answers:
            return httpx.Response(400, json={"status": "error", "errorType": "bad_data", "error": "unknown"})
        return httpx.Response(200, json=answers[form["query"]])

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_client_observes_value_and_freshness_together() -> None:
    assert QUERY.freshness is not None
    answers = {
        QUERY.value: vector(({"pod": "a"}, 90), ({"pod": "b"}, 50)),
        QUERY.freshness: vector(({"pod": "a"}, NOW - 4), ({"pod": "b"}, NOW - 6)),
    }
    seen: list[dict[str, str]] = []
    async with _prometheus(answers, seen) as http:
        client = PrometheusClient("http://prom.local:9090/prom/", client=http)
        m = await client.observe(QUERY, now=NOW, max_age_seconds=30, ready_pods=["a", "b"])
    assert m == MetricValue(value=70.0, timestamp=NOW - 6, scope="per-pod", pods=2)
    assert {form["time"] for form in seen} == {f"{NOW:.3f}"}  # both evaluated at the same instant


async def test_client_turns_errors_into_query_failed() -> None:
    seen: list[dict[str, str]] = []
    async with _prometheus({}, seen) as http:
        client = PrometheusClient("http://prom.local:9090/prom", client=http)
        m = await client.observe(QUERY, now=NOW, max_age_seconds=30)
        assert isinstance(m, MetricUnavailable) and m.reason == "QueryFailed" and "bad_data" in m.message
        with pytest.raises(PrometheusError, match="bad_data"):
            await client.query("nonsense")

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(broken)) as http:
        client = PrometheusClient("http://prom.local:9090", client=http)
        m = await client.observe(QUERY, now=NOW, max_age_seconds=30)
    assert isinstance(m, MetricUnavailable) and m.reason == "QueryFailed" and "unreachable" in m.message

    def html(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>bad gateway</html>")

    async with httpx.AsyncClient(transport=httpx.MockTransport(html)) as http:
        with pytest.raises(PrometheusError, match="HTTP 502 without JSON"):
            await PrometheusClient("http://prom.local:9090", client=http).query("up")


async def test_workload_query_asks_once() -> None:
    q = build_query("prometheus", PODS, promql="my_queue")
    seen: list[dict[str, str]] = []
    async with _prometheus({q.value: vector(({}, 12))}, seen) as http:
        m = await PrometheusClient("http://p:9090/prom", client=http).observe(q, now=NOW, max_age_seconds=30)
    assert m == MetricValue(value=12.0, timestamp=NOW, scope="workload")
    assert len(seen) == 1


def test_client_rejects_a_url_without_scheme() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        PrometheusClient("prometheus:9090")

