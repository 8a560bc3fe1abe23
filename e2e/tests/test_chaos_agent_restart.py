"""Chaos: the node agent restarted while an InferenceService serves under load (loom.e2e.chaos.serving): its pods
survive the restart (same pods, no container restart) and serving resumes; the failed requests are reported.
`make chaos` also keeps the agent away until the node is NotReady.

Restarts the shared stack's node agent: serial (the lead runs serial tests alone)."""

from __future__ import annotations

import pytest

from loom.devstack.cluster import Cluster
from loom.devstack.servers import S3Endpoint
from loom.e2e.chaos.load import p50_p99
from loom.e2e.chaos.serving import agent_restart
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]


def test_pods_survive_an_agent_restart_and_serving_resumes(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint, bucket: str
) -> None:
    figures = agent_restart(cluster, loom_operator, operator_namespace, s3, bucket, rps=40, down_s=1.0)
    summary = {k: v for k, v in figures.items() if not k.endswith("_ms")}
    print(f"agent restart: {summary}, after the restart {p50_p99(figures['latency_after_ms'])}")
    assert figures["problems"] == []
    assert figures["pods_replaced"] == 0 and figures["container_restarts"] == 0
    assert figures["latency_after_ms"], "nothing answered after the restart"
    assert figures["versions"] == {"v1": figures["requests"] - figures["failed_requests"]}
