"""PromQL for each autoscaling metric kind, for one workload's pods."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loom.operator.autoscale.promql import (
    INFLIGHT,
    METRIC_KINDS,
    QUEUE_DEPTH,
    REQUESTS,
    WORK_ENDPOINTS,
    PodSelector,
    build_query,
    quote,
)
from loom.operator.autoscale.spec import metric_query, scaling_config
from loom.operator.kinds.inferenceservice.api import Autoscaling

PODS = PodSelector.for_pods("team-a", ["chat-7d9f-abcde", "chat-7d9f-fghij"])
SEL = 'namespace="team-a",pod=~"chat-7d9f-abcde|chat-7d9f-fghij"'
EXPORTED = 'exported_namespace="team-a",exported_pod=~"chat-7d9f-abcde|chat-7d9f-fghij"'


def test_gpu_utilization_prefers_gr_engine_active_then_util_under_both_attributions() -> None:
    q = build_query("gpu-utilization", PODS)
    assert q.scope == "per-pod"
    branches = q.value.split(" or ")
    assert branches == [
        f"(100 * avg by (pod) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{SEL}}}))",
        f'(100 * avg by (pod) (label_replace(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{EXPORTED}}}, "pod", "$1", '
        f'"exported_pod", "(.+)")))',
        f"(avg by (pod) (DCGM_FI_DEV_GPU_UTIL{{{SEL}}}))",
        f'(avg by (pod) (label_replace(DCGM_FI_DEV_GPU_UTIL{{{EXPORTED}}}, "pod", "$1", "exported_pod", "(.+)")))',
    ]
    assert q.freshness is not None
    assert q.freshness.startswith(f"(min by (pod) (timestamp(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{SEL}}})))")
    assert f"timestamp(DCGM_FI_DEV_GPU_UTIL{{{EXPORTED}}})" in q.freshness


def test_gpu_memory_is_percent_of_framebuffer_used() -> None:
    q = build_query("gpu-memory", PODS)
    used, free = f"DCGM_FI_DEV_FB_USED{{{SEL}}}", f"DCGM_FI_DEV_FB_FREE{{{SEL}}}"
    assert q.value.startswith(f"(avg by (pod) (100 * {used} / ({used} + {free})))")
    assert "DCGM_FI_DEV_FB_USED{exported_namespace=" in q.value
    assert q.freshness is not None and f"timestamp({used})" in q.freshness


@pytest.mark.parametrize(
    ("kind", "load"),
    [
        ("queue-depth", f"sum by (pod) (loom_server_queue_depth{{{SEL}}})"),
        ("concurrency", f"sum by (pod) (loom_server_inflight_requests{{{SEL}}})"),
        (
            "requests-per-second",
            f'sum by (pod) (rate(loom_server_requests_total{{{SEL},endpoint=~"infer|generate|generate_stream"}}[30s]))',
        ),
    ],
)
def test_server_metrics_read_the_servers_own_series_and_count_a_scraped_pod_without_them_as_zero(
    kind: str, load: str
) -> None:
    q = build_query(kind, PODS)  # type: ignore[arg-type]
    assert q.value == f"({load}) or (max by (pod) (0 * (up{{{SEL}}} == 1)))"
    assert q.freshness == f"min by (pod) (timestamp(up{{{SEL}}}))"


def test_server_metric_names_and_labels_match_what_the_server_exposes() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from loom.workloads.server.metrics import ServerMetrics

    m = ServerMetrics("chat")
    m.queue_depth(3)
    m.inflight.labels("chat").inc()
    for endpoint in WORK_ENDPOINTS:
        m.answered(endpoint, 200, 0.01)
    exposed = {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(generate_latest(m.registry).decode())
        for s in family.samples
    }
    names = {name for name, _ in exposed}
    assert {QUEUE_DEPTH, INFLIGHT, REQUESTS} <= names
    endpoints = {dict(labels).get("endpoint") for name, labels in exposed if name == REQUESTS}
    assert endpoints == set(WORK_ENDPOINTS)
    for kind, name in (("queue-depth", QUEUE_DEPTH), ("concurrency", INFLIGHT), ("requests-per-second", REQUESTS)):
        assert f"{name}{{" in build_query(kind, PODS).value  # type: ignore[arg-type]


def test_rate_window_is_configurable() -> None:
    assert "[1m0s]" not in build_query("requests-per-second", PODS, rate_window_seconds=60).value
    assert "[60s]" in build_query("requests-per-second", PODS, rate_window_seconds=60).value
    with pytest.raises(ValueError, match="rate_window_seconds"):
        build_query("requests-per-second", PODS, rate_window_seconds=0)


def test_user_promql_is_one_number_for_the_workload() -> None:
    q = build_query("prometheus", PODS, promql='  vllm:num_requests_waiting{model_name="chat"}\n')
    assert (q.scope, q.freshness) == ("workload", None)
    assert q.value == 'vllm:num_requests_waiting{model_name="chat"}'
    with pytest.raises(ValueError, match="needs a PromQL query"):
        build_query("prometheus", PODS)
    with pytest.raises(ValueError, match="only accepted for metric 'prometheus'"):
        build_query("concurrency", PODS, promql="up")


def test_every_kind_builds() -> None:
    for kind in METRIC_KINDS:
        q = build_query(kind, PODS, promql="up" if kind == "prometheus" else None)
        assert q.kind == kind and q.value


def test_pod_selectors_escape_and_validate_names() -> None:
    dotted = PodSelector.for_pods("ns", ["a.b-1", "a.b-1", "c"])
    assert dotted.pod_regex == "a\\.b-1|c"  # deduplicated, sorted, the dot literal
    assert '=~"a\\\\.b-1|c"' in build_query("concurrency", dotted).value  # PromQL string escaping
    owner = PodSelector.for_owner("ns", "chat")
    assert owner.pod_regex == "chat-[a-z0-9]+-[a-z0-9]+"
    with pytest.raises(ValueError, match="DNS subdomain"):
        PodSelector.for_pods("ns", ['x"} or vector(1) or {a="'])
    with pytest.raises(ValueError, match="at least one pod"):
        PodSelector.for_pods("ns", [])
    with pytest.raises(ValidationError, match="DNS label"):
        PodSelector(namespace="Bad_NS", pod_regex=".*")


def test_quote_escapes_like_go() -> None:
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'


def test_inferenceservice_spec_maps_onto_the_decision_and_the_query() -> None:
    spec = Autoscaling.model_validate(
        {
            "minReplicas": 0, "maxReplicas": 8, "metric": "gpu-utilization", "target": 70,
            "scaleUp": {"stabilizationWindowSeconds": 30}, "scaleDown": {"stabilizationWindowSeconds": 600},
        }
    )
    cfg = scaling_config(spec)
    assert (cfg.min_replicas, cfg.max_replicas, cfg.target) == (0, 8, 70)
    assert cfg.scale_up.stabilization_window_seconds == 30
    assert cfg.scale_down.stabilization_window_seconds == 600
    assert cfg.scale_up.policies  # HPA's default rate limits until the API can say otherwise
    q = metric_query(spec, "team-a", ["svc-1-a", "svc-canary-2-b"])
    assert q.kind == "gpu-utilization" and 'pod=~"svc-1-a|svc-canary-2-b"' in q.value
