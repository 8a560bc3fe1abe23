"""PromQL for the canary analysis' checks, for one version (track) of one service (pure).

A version is its track's pods: Prometheus labels every scraped series with `namespace` and `pod`, and a track's
pods are named by its Deployment (<service>-<track>-<template hash>-<suffix>), so a check reads the canary and
the stable version with the same query over different pods. Each query answers one number over `window`; with no
traffic in the window a ratio is NaN and a quantile has no buckets: the analysis reads both as missing data.

- error-rate: 5xx answers / all answers of the work endpoints (the model server's `loom_server_requests_total`; the
  vllm runtime's front counts its own answers in `loom_llm_requests_total`);
- latency-p99: the 99th percentile of the request duration (vllm: the front's end-to-end latency);
- ttft-p99: the 99th percentile of the time to first token the vllm front measured;
- prometheus: the user's query with {{version}}, {{namespace}}, {{pods}} and {{window}} filled in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....autoscale.promql import REQUESTS, WORK_ENDPOINTS, PodSelector, quote
from ....autoscale.promql_llm import TTFT
from .api import AnalysisCheck

LATENCY = "loom_server_request_duration_seconds"
LLM_REQUESTS = "loom_llm_requests_total"
LLM_LATENCY = "loom_llm_e2e_request_latency_seconds"
PLACEHOLDERS = ("{{version}}", "{{namespace}}", "{{pods}}", "{{window}}")


@dataclass(frozen=True)
class Version:
    """One side of the comparison: its model version label and its pods."""

    version: str
    pods: PodSelector


def _sel(metric: str, pods: PodSelector, *extra: str) -> str:
    matchers = [f"namespace={quote(pods.namespace)}", f"pod=~{quote(pods.pod_regex)}", *extra]
    return f"{metric}{{{','.join(matchers)}}}"


def check_query(check: AnalysisCheck, side: Version, *, runtime: str, window_seconds: int) -> str:
    """The PromQL answering `check`'s value for one version over the window."""
    window = f"{window_seconds}s"
    if check.metric == "prometheus":
        assert check.query is not None
        return fill(check.query, side, window)
    if check.metric == "error-rate":
        if runtime == "vllm":
            answered = _sel(LLM_REQUESTS, side.pods)
            errors = _sel(LLM_REQUESTS, side.pods, 'code=~"5.."')
        else:
            work = 'endpoint=~"' + "|".join(WORK_ENDPOINTS) + '"'
            answered = _sel(REQUESTS, side.pods, work)
            errors = _sel(REQUESTS, side.pods, work, 'code=~"5.."')
        # `or vector(0)` for the errors only: no 5xx series yet is zero errors, but no answers at all is no data.
        return f"(sum(rate({errors}[{window}])) or vector(0)) / sum(rate({answered}[{window}]))"
    if check.metric == "latency-p99":
        metric = LLM_LATENCY if runtime == "vllm" else LATENCY
        extra = () if runtime == "vllm" else ('endpoint=~"' + "|".join(WORK_ENDPOINTS) + '"',)
        return _quantile(_sel(f"{metric}_bucket", side.pods, *extra), window)
    if check.metric == "ttft-p99":
        return _quantile(_sel(f"{TTFT}_bucket", side.pods), window)
    raise ValueError(f"unknown analysis metric {check.metric!r}")


def _quantile(buckets: str, window: str) -> str:
    # NaN (no observation in the window) is dropped by `>= 0`: an empty answer, read as missing data.
    return f"(histogram_quantile(0.99, sum by (le) (rate({buckets}[{window}]))) >= 0)"


def fill(query: str, side: Version, window: str) -> str:
    """The user's PromQL with the placeholders replaced (values are escaped for a PromQL string literal)."""
    def inner(value: str) -> str:
        return quote(value)[1:-1]

    return (
        query.replace("{{version}}", inner(side.version))
        .replace("{{namespace}}", inner(side.pods.namespace))
        .replace("{{pods}}", inner(side.pods.pod_regex))
        .replace("{{window}}", window)
    )
