"""The local stack's real Prometheus finds pods through the API server and scrapes them; the autoscaler's
queries for every metric kind run on it unchanged."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.prometheus import PrometheusEndpoint
from loom.e2e.exporter import exporter_pod
from loom.operator.autoscale.decision import MetricUnavailable, MetricValue
from loom.operator.autoscale.prometheus import PrometheusClient
from loom.operator.autoscale.promql import MetricKind, PodSelector, build_query

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

# The model server's gauges for the exporter itself, and dcgm-exporter-style GPU series for another pod
# ("chat-a", labelled pod/namespace as dcgm-exporter does): Prometheus renames those labels to
# exported_pod/exported_namespace because the target has its own pod/namespace.
def _series(namespace: str) -> str:
    gpu = f'gpu="0",UUID="GPU-1",pod="chat-a",namespace="{namespace}"'
    return (
        'loom_server_inflight_requests{model="m"} 3\n'
        'loom_server_queue_depth{model="m"} 0\n'
        f"DCGM_FI_DEV_GPU_UTIL{{{gpu}}} 85\n"
        f"DCGM_FI_DEV_FB_USED{{{gpu}}} 3000\n"
        f"DCGM_FI_DEV_FB_FREE{{{gpu}}} 1000\n"
        # What the vllm runtime's front exposes: vLLM's engine gauges passed through, and its own TTFT histogram
        # (no stream in the window here: its rate is 0).
        'vllm:num_requests_waiting{model_name="m",engine="0"} 4\n'
        'vllm:num_requests_running{model_name="m",engine="0"} 8\n'
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
        'loom_llm_time_to_first_token_seconds_bucket{model="m",le="0.5"} 3\n'
        'loom_llm_time_to_first_token_seconds_bucket{model="m",le="+Inf"} 3\n'
        'loom_llm_time_to_first_token_seconds_count{model="m"} 3\n'
        'loom_llm_time_to_first_token_seconds_sum{model="m"} 0.6\n'
    )


def _exporter_pod(namespace: str) -> dict[str, Any]:
    # Served without a Content-Type, on a path of its own, with a declared port other than the annotated one
    # (the annotation wins).
    return exporter_pod(
        "exporter",
        path="/custom-metrics",
        initial=_series(namespace),
        extra_ports=[{"name": "http", "containerPort": 8080}],
    )



async def _eventually(
    client: PrometheusClient, kind: MetricKind, pods: PodSelector, *, want: type, promql: str | None = None
) -> MetricValue | MetricUnavailable:
    query = build_query(kind, pods, promql=promql)
    deadline = time.monotonic() + 90
    while True:
        seen = await client.observe(query, now=time.time(), max_age_seconds=30)
        if isinstance(seen, want) or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.5)


async def test_prometheus_discovers_and_scrapes_annotated_pods(
    cluster: Cluster, namespace: str, prometheus: PrometheusEndpoint
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(_exporter_pod(namespace)))
    exporter = PodSelector.for_pods(namespace, ["exporter"])
    chat = PodSelector.for_pods(namespace, ["chat-a"])
    async with PrometheusClient(prometheus.url) as client:
        inflight = await _eventually(client, "concurrency", exporter, want=MetricValue)
        assert isinstance(inflight, MetricValue), f"{inflight}; log: {prometheus.log_file}"
        assert (inflight.value, inflight.pods) == (3.0, 1)
        assert time.time() - inflight.timestamp < 30  # the sample's own scrape time, not the query's

        # The target carries the pod's identity from discovery, and the annotated port and path.
        up = await client.query(f'up{{namespace="{namespace}"}}')
        assert [(s.labels["pod"], s.labels["instance"].split(":")[1], s.value) for s in up] == [
            ("exporter", "9400", 1.0)
        ]
        assert up[0].labels["instance"].startswith("127.")
        assert up[0].labels["node"] == AGENT_NODE_NAME

        queue = await client.observe(build_query("queue-depth", exporter), now=time.time(), max_age_seconds=30)
        assert isinstance(queue, MetricValue) and queue.value == 0.0
        # No request counter yet: a scraped pod without it has served nothing (0), it is not "missing".
        rps = await client.observe(build_query("requests-per-second", exporter), now=time.time(), max_age_seconds=30)
        assert isinstance(rps, MetricValue) and rps.value == 0.0

        # The vllm runtime's metrics, as its autoscaler reads them: requests waiting in the engine (what
        # llm-waiting-requests scales on), KV-cache use in percent, and a TTFT p95 of 0 for a pod that streamed
        # nothing in the window (idle, not missing).
        waiting = await _eventually(client, "llm-waiting-requests", exporter, want=MetricValue)
        assert isinstance(waiting, MetricValue) and (waiting.value, waiting.pods) == (4.0, 1), waiting
        kv = await client.observe(build_query("llm-kv-cache-usage", exporter), now=time.time(), max_age_seconds=30)
        assert isinstance(kv, MetricValue) and kv.value == 25.0, kv
        ttft = await client.observe(build_query("llm-ttft-p95", exporter), now=time.time(), max_age_seconds=30)
        assert isinstance(ttft, MetricValue) and ttft.value == 0.0, ttft

        # dcgm-exporter attribution through exported_pod / exported_namespace.
        util = await client.observe(build_query("gpu-utilization", chat), now=time.time(), max_age_seconds=30)
        assert isinstance(util, MetricValue) and (util.value, util.pods) == (85.0, 1)
        memory = await client.observe(build_query("gpu-memory", chat), now=time.time(), max_age_seconds=30)
        assert isinstance(memory, MetricValue) and memory.value == 75.0

        # A user's query: a vector (its series summed) or a scalar.
        users = build_query("prometheus", chat, promql=f'loom_server_inflight_requests{{namespace="{namespace}"}} * 2')
        total = await client.observe(users, now=time.time(), max_age_seconds=30)
        assert isinstance(total, MetricValue) and (total.value, total.scope) == (6.0, "workload")
        scalar = build_query("prometheus", chat, promql=f'scalar(sum(up{{namespace="{namespace}"}})) + 1')
        two = await client.observe(scalar, now=time.time(), max_age_seconds=30)
        assert isinstance(two, MetricValue) and two.value == 2.0

        nobody = await client.observe(
            build_query("gpu-utilization", PodSelector.for_pods(namespace, ["nobody"])),
            now=time.time(),
            max_age_seconds=30,
        )
        assert isinstance(nobody, MetricUnavailable) and nobody.reason == "MetricMissing"

        # The pod goes away: its series end (staleness markers), so the metric is missing, not frozen.
        cluster.kubectl("delete", "pod", "-n", namespace, "exporter", "--wait=true")
        gone = await _eventually(client, "concurrency", exporter, want=MetricUnavailable)
        assert isinstance(gone, MetricUnavailable) and gone.reason == "MetricMissing"

