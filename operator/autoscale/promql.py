"""PromQL for each autoscaling metric, for the pods of one workload (pure; no kind, no I/O).

Every per-pod query answers one series per pod, labelled `pod`, so the decision can tell which ready
pods reported. A second query (`freshness`) answers when each pod's samples were taken: an instant
query returns the evaluation time and Prometheus looks back up to 5 minutes, so without it a pod whose
exporter stopped four minutes ago would still look current.

GPU series follow dcgm-exporter. Its series name the workload pod either as `pod`/`namespace` (the
exporter's own labels, or Prometheus' target labels when the server exports them itself through NVML)
or as `exported_pod`/`exported_namespace` (a dcgm-exporter DaemonSet scraped without honor_labels:
Prometheus renames the exporter's `pod` because the target has its own). Both are asked, in that order,
and `or` keeps the first answer per pod. DCGM_FI_PROF_GR_ENGINE_ACTIVE (a 0..1 ratio, only where
profiling metrics are enabled) measures how busy the GPU really is and is preferred over
DCGM_FI_DEV_GPU_UTIL wherever a pod has it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .promql_llm import LLM_KINDS, llm_load

MetricKind = Literal[
    "gpu-utilization", "gpu-memory", "queue-depth", "concurrency", "requests-per-second", "prometheus",
    "llm-waiting-requests", "llm-kv-cache-usage", "llm-ttft-p95",
]
METRIC_KINDS: tuple[MetricKind, ...] = (
    "gpu-utilization", "gpu-memory", "queue-depth", "concurrency", "requests-per-second", "prometheus",
    "llm-waiting-requests", "llm-kv-cache-usage", "llm-ttft-p95",
)

# The model server's own series (loom.workloads.server.metrics): prometheus_client adds _total to counters.
QUEUE_DEPTH = "loom_server_queue_depth"
INFLIGHT = "loom_server_inflight_requests"
REQUESTS = "loom_server_requests_total"
# Endpoints that do work; probes and metadata reads are not load.
WORK_ENDPOINTS = ("infer", "generate", "generate_stream")

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
# (namespace label, pod label) pairs a series may name its workload pod with, in order of preference.
_DIRECT = ("namespace", "pod")
_EXPORTED = ("exported_namespace", "exported_pod")


class PodSelector(BaseModel):
    """The pods of one workload: a namespace and an RE2 regex the whole pod name must match."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str
    pod_regex: str = Field(min_length=1)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if len(value) > 63 or not _DNS_LABEL.match(value):
            raise ValueError(f"namespace must be a DNS label, got {value!r}")
        return value

    @classmethod
    def for_pods(cls, namespace: str, names: Iterable[str]) -> PodSelector:
        """Exactly these pods (e.g. the ready ones the controller listed)."""
        names = sorted(set(names))
        if not names:
            raise ValueError("a pod selector needs at least one pod name")
        for name in names:
            if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
                raise ValueError(f"pod name must be a DNS subdomain, got {name!r}")
        return cls(namespace=namespace, pod_regex="|".join(_literal(n) for n in names))

    @classmethod
    def for_owner(cls, namespace: str, owner: str) -> PodSelector:
        """Pods a Deployment named `owner` creates: <owner>-<template hash>-<5 characters>."""
        if len(owner) > 253 or not _DNS_SUBDOMAIN.match(owner):
            raise ValueError(f"owner name must be a DNS subdomain, got {owner!r}")
        return cls(namespace=namespace, pod_regex=f"{_literal(owner)}-[a-z0-9]+-[a-z0-9]+")


class MetricQuery(BaseModel):
    """What to ask Prometheus for one metric of one workload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MetricKind
    scope: Literal["per-pod", "workload"]
    value: str = Field(description="PromQL; per-pod: one series per pod, labelled pod.")
    freshness: str | None = Field(
        None, description="PromQL: per pod, the Unix time of its oldest sample in use. None: not knowable."
    )


def quote(value: str) -> str:
    """A PromQL double-quoted string literal (Go escaping)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def build_query(
    kind: MetricKind,
    pods: PodSelector,
    *,
    promql: str | None = None,
    rate_window_seconds: int = 30,
) -> MetricQuery:
    """The query for `kind`; `promql` is the user's own query, for kind `prometheus` only.

    rate_window_seconds must cover at least two scrapes (four is the usual advice) for rate() to answer.
    """
    if kind == "prometheus":
        if promql is None or not promql.strip():
            raise ValueError("metric 'prometheus' needs a PromQL query")
        # The user's query is one number for the workload: a scalar, or a vector whose series are summed
        # when read (not wrapped in sum(), which a scalar would fail). Its sample age cannot be derived
        # from an arbitrary expression.
        return MetricQuery(kind=kind, scope="workload", value=promql.strip())
    if promql is not None:
        raise ValueError(f"a PromQL query is only accepted for metric 'prometheus', not {kind!r}")
    if rate_window_seconds < 1:
        raise ValueError("rate_window_seconds must be >= 1")
    if kind == "gpu-utilization":
        value = _first(
            *(f"100 * {_by_pod('avg', _sel(GR_ENGINE_ACTIVE, pods, a), a)}" for a in (_DIRECT, _EXPORTED)),
            *(_by_pod("avg", _sel(GPU_UTIL, pods, a), a) for a in (_DIRECT, _EXPORTED)),
        )
        fresh = _first(
            *(_by_pod("min", f"timestamp({_sel(m, pods, a)})", a) for m in (GR_ENGINE_ACTIVE, GPU_UTIL)
              for a in (_DIRECT, _EXPORTED)),
        )
    elif kind == "gpu-memory":
        # Percent of the framebuffer in use: the API's target for GPU metrics is a percentage.
        def used_percent(a: tuple[str, str]) -> str:
            used, free = _sel(FB_USED, pods, a), _sel(FB_FREE, pods, a)
            return _by_pod("avg", f"100 * {used} / ({used} + {free})", a)

        value = _first(*(used_percent(a) for a in (_DIRECT, _EXPORTED)))
        fresh = _first(*(_by_pod("min", f"timestamp({_sel(FB_USED, pods, a)})", a) for a in (_DIRECT, _EXPORTED)))
    else:
        # The server's own series come from scraping the pod itself, so they carry the target's
        # pod/namespace labels. A gauge with labels exists only once set, and a counter only once
        # counted: a pod that is scraped (up == 1) but has none of them yet has seen no load, i.e. 0.
        if kind in LLM_KINDS:
            load = llm_load(kind, lambda metric: _sel(metric, pods, _DIRECT), rate_window_seconds)
        elif kind == "queue-depth":
            load = _by_pod("sum", _sel(QUEUE_DEPTH, pods, _DIRECT), _DIRECT)
        elif kind == "concurrency":
            load = _by_pod("sum", _sel(INFLIGHT, pods, _DIRECT), _DIRECT)
        else:
            work = 'endpoint=~"' + "|".join(WORK_ENDPOINTS) + '"'
            counter = _sel(REQUESTS, pods, _DIRECT, work)
            load = _by_pod("sum", f"rate({counter}[{rate_window_seconds}s])", _DIRECT)
        up = _sel("up", pods, _DIRECT)
        value = _first(load, _by_pod("max", f"0 * ({up} == 1)", _DIRECT))
        # The scrape time of each pod's target: its series cannot be newer or older than that.
        fresh = _by_pod("min", f"timestamp({up})", _DIRECT)
    return MetricQuery(kind=kind, scope="per-pod", value=value, freshness=fresh)


def _literal(name: str) -> str:
    """A DNS name as an RE2 literal: the dot is its only special character."""
    return name.replace(".", "\\.")


def _sel(metric: str, pods: PodSelector, attribution: tuple[str, str], extra: str = "") -> str:
    ns_label, pod_label = attribution
    matchers = [f"{ns_label}={quote(pods.namespace)}", f"{pod_label}=~{quote(pods.pod_regex)}"]
    if extra:
        matchers.append(extra)
    return f"{metric}{{{','.join(matchers)}}}"


def _by_pod(aggregation: str, expr: str, attribution: tuple[str, str]) -> str:
    pod_label = attribution[1]
    if pod_label != "pod":
        expr = f'label_replace({expr}, "pod", "$1", {quote(pod_label)}, "(.+)")'
    return f"{aggregation} by (pod) ({expr})"


def _first(*alternatives: str) -> str:
    """Per pod, the first alternative that has a series for it."""
    return " or ".join(f"({a})" for a in alternatives)
