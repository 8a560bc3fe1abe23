"""Chaos: a steady open-loop load held through a rollout, a canary promotion and a scale-down drops no request
(loom.e2e.chaos.serving). The test offers 50 requests per second; `make chaos` runs 200."""

from __future__ import annotations

import pytest

from loom.devstack.cluster import Cluster
from loom.devstack.servers import S3Endpoint
from loom.e2e.chaos.load import p50_p99
from loom.e2e.chaos.serving import serving_load
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_no_request_fails_through_rollout_canary_promotion_and_scale_down(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint, bucket: str
) -> None:
    figures = serving_load(
        cluster, loom_operator, operator_namespace, s3, bucket, rps=50, before_s=3, max_s=150, replicas=2
    )
    print(
        f"serving load: {figures['requests']} requests at {figures['rps_achieved']} rps, "
        f"{figures['failed_requests']} failed, before {p50_p99(figures['latency_before_ms'])}, "
        f"during {p50_p99(figures['latency_during_ms'])}, steps {figures['steps']}, versions {figures['versions']}"
    )
    assert figures["failed_requests"] == 0, figures["failure_examples"]
    assert figures["problems"] == []
    # Every version answered in turn, and each change happened while the load ran.
    assert set(figures["versions"]) == {"v1", "v2", "v3"}
    for phase in ("before", "rollout", "canary", "promotion", "scale-down", "after"):
        assert figures[f"latency_{phase}_ms"], f"no request answered during {phase}"
