"""Engines keda and hpa: the ScaledObject and the HorizontalPodAutoscaler rendered from spec.autoscaling."""

from __future__ import annotations

import re

import pytest

from loom.operator.autoscale.engines import (
    EngineError,
    behavior,
    decimal,
    quantity,
    render_hpa,
    render_scaled_object,
)
from loom.operator.autoscale.spec import scaling_config
from loom.operator.kinds.inferenceservice.api import Autoscaling

META = {"name": "chat", "namespace": "team-a"}
TARGET = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "name": "chat"}
DEPLOYMENTS = ["chat", "chat-canary"]


def config(**fields: object) -> Autoscaling:
    return Autoscaling.model_validate({"maxReplicas": 6, "target": 60, **fields})


def test_quantities_are_exact() -> None:
    assert (quantity(60), quantity(0.5), quantity(2.25), quantity(0)) == ("60", "500m", "2250m", "0")
    # KEDA reads trigger thresholds as JSON numbers: a quantity's "2250m" would fail there.
    assert (decimal(60), decimal(0.5), decimal(2.25), decimal(0)) == ("60", "0.5", "2.25", "0")


def test_behaviour_speaks_autoscaling_v2() -> None:
    a = config(scaleUp={"policies": [{"type": "Pods", "value": 2, "periodSeconds": 15}], "selectPolicy": "Min"})
    out = behavior(scaling_config(a))
    assert out["scaleUp"] == {
        "stabilizationWindowSeconds": 0, "selectPolicy": "Min",
        "policies": [{"type": "Pods", "value": 2, "periodSeconds": 15}],
    }  # fmt: skip
    assert out["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert out["scaleDown"]["policies"] == [{"type": "Percent", "value": 100, "periodSeconds": 15}]


def test_scaled_object_sums_the_per_pod_query_over_both_tracks_as_an_average_value() -> None:
    a = config(minReplicas=0, idleSeconds=120, metric="gpu-utilization")
    obj = render_scaled_object(
        META, TARGET, scaling_config(a), a.metric, DEPLOYMENTS, prometheus_url="http://prometheus.monitoring:9090"
    )
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == TARGET
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 6, 120)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["threshold"] == "60" and meta["serverAddress"] == "http://prometheus.monitoring:9090"
    assert meta["query"].startswith("sum((") and "DCGM_FI_DEV_GPU_UTIL" in meta["query"]
    assert 'pod=~"chat-[a-z0-9]+-[a-z0-9]+|chat-canary-[a-z0-9]+-[a-z0-9]+"' in meta["query"]
    assert re.fullmatch("chat-[a-z0-9]+-[a-z0-9]+|chat-canary-[a-z0-9]+-[a-z0-9]+", "chat-7d9f8-abcde")
    hpa = spec["advanced"]["horizontalPodAutoscalerConfig"]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_scaled_object_uses_a_users_query_as_written() -> None:
    a = config(metric="prometheus", query="sum(rate(tokens_total[1m]))", target=500)
    obj = render_scaled_object(
        META, TARGET, scaling_config(a), a.metric, DEPLOYMENTS, prometheus_url="http://p:9090", promql=a.query
    )
    assert obj["spec"]["triggers"][0]["metadata"]["query"] == "sum(rate(tokens_total[1m]))"
    assert "cooldownPeriod" not in obj["spec"]
    with pytest.raises(EngineError, match="LOOM_PROMETHEUS_URL"):
        render_scaled_object(META, TARGET, scaling_config(a), a.metric, DEPLOYMENTS, prometheus_url="", promql=a.query)


def test_hpa_scales_on_adapter_pod_metrics_and_refuses_what_has_no_single_series() -> None:
    a = config(minReplicas=0, idleSeconds=60, metric="queue-depth", target=4)
    obj = render_hpa(META, TARGET, scaling_config(a), a.metric)
    assert (obj["apiVersion"], obj["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert (obj["spec"]["minReplicas"], obj["spec"]["maxReplicas"]) == (1, 6)  # no HPAScaleToZero assumed
    assert obj["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "loom_server_queue_depth"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }
    ]
    rps = config(metric="requests-per-second", target=2.5)
    assert render_hpa(META, TARGET, scaling_config(rps), rps.metric)["spec"]["metrics"][0]["pods"] == {
        "metric": {"name": "loom_server_requests_per_second"},
        "target": {"type": "AverageValue", "averageValue": "2500m"},
    }
    for metric, extra in (("gpu-memory", {}), ("prometheus", {"query": "up"})):
        bad = config(metric=metric, **extra)
        with pytest.raises(EngineError, match=f"cannot scale on {metric}"):
            render_hpa(META, TARGET, scaling_config(bad), bad.metric)
