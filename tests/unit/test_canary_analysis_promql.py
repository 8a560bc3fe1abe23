"""PromQL of the canary analysis' checks: one version is its track's pods; placeholders filled and escaped."""

from __future__ import annotations

from loom.operator.autoscale.promql import PodSelector
from loom.operator.kinds.inferenceservice.canary.api import AnalysisCheck
from loom.operator.kinds.inferenceservice.canary.promql import Version, check_query

CANARY = Version("3", PodSelector.for_owner("ml", "chat-canary"))
SEL = 'namespace="ml",pod=~"chat-canary-[a-z0-9]+-[a-z0-9]+"'


def check(**wire: object) -> AnalysisCheck:
    return AnalysisCheck.model_validate({"name": "c", "max": 1, **wire})


def test_error_rate_counts_5xx_of_work_endpoints_and_no_traffic_is_no_data() -> None:
    q = check_query(check(metric="error-rate"), CANARY, runtime="default", window_seconds=60)
    work = 'endpoint=~"infer|generate|generate_stream"'
    assert q == (
        f'(sum(rate(loom_server_requests_total{{{SEL},{work},code=~"5.."}}[60s])) or vector(0)) / '
        f"sum(rate(loom_server_requests_total{{{SEL},{work}}}[60s]))"
    )
    llm = check_query(check(metric="error-rate"), CANARY, runtime="vllm", window_seconds=30)
    assert "loom_llm_requests_total" in llm and "[30s]" in llm and "endpoint" not in llm


def test_latency_and_ttft_are_p99_over_the_window() -> None:
    q = check_query(check(metric="latency-p99"), CANARY, runtime="default", window_seconds=60)
    assert q.startswith("(histogram_quantile(0.99, sum by (le) (rate(loom_server_request_duration_seconds_bucket{")
    assert q.endswith("[60s]))) >= 0)")
    ttft = check_query(check(metric="ttft-p99"), CANARY, runtime="vllm", window_seconds=60)
    assert f"loom_llm_time_to_first_token_seconds_bucket{{{SEL}}}[60s]" in ttft


def test_user_query_placeholders() -> None:
    user = check(metric="prometheus", query='sum(rate(app_bad{namespace="{{namespace}}",pod=~"{{pods}}",'
                                            'v="{{version}}"}[{{window}}]))')
    q = check_query(user, Version('a"b', CANARY.pods), runtime="default", window_seconds=45)
    assert q == 'sum(rate(app_bad{namespace="ml",pod=~"chat-canary-[a-z0-9]+-[a-z0-9]+",v="a\\"b"}[45s]))'
