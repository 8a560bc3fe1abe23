"""In a steady state the operator asks the API server for nothing (issue 23): with 50 settled objects, a quiet
minute of passes (the resync every 10 s, running TrainingJobs every second) makes no GET, no LIST and no write,
counted from the API server's audit log for the operator's own identity. Passes read their objects and children
from the watch cache and skip applies that would change nothing (operator/core/watch_cache.py)."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.components import kubeconfig_path
from loom.devstack.cluster.paths import AUDIT_LOG
from loom.e2e.audit import audit_offset, operator_requests, what
from loom.e2e.chaos.churn import _namespace, create, mixed_objects, settled
from loom.e2e.chaos.kwok_only import kwok_only
from loom.e2e.pytest_operator import apply_crds, operator_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

OBJECTS = 50
QUIET_S = 60.0


def passes(metrics_port: int) -> float:
    """Reconcile passes the operator has run so far, all kinds."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^loom_reconcile_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M))


def test_a_quiet_minute_with_fifty_settled_objects_asks_the_api_server_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    apply_crds(cluster)
    assert AUDIT_LOG.exists(), "the stack's API server writes no audit log (`loom dev down && loom dev up`)"
    env = {"KUBECONFIG": str(kubeconfig_path("audited-operator")), "LOOM_RESYNC_INTERVAL_S": "10"}
    objects = mixed_objects(OBJECTS, "s")
    with (
        cluster.api_client() as api,
        _namespace(cluster, "lquiet") as ns,
        kwok_only(api, ns),
        operator_process(cluster, tmp_path / "operator.log", env, prefix="lquiet") as op,
    ):
        for obj in objects:
            create(api, ns, obj)
        settled(api, ns, [o["metadata"]["name"] for o in objects], quiet_s=10, timeout=600)
        offset, passes_before = audit_offset(), passes(op.metrics_port)
        time.sleep(QUIET_S)
        requests = operator_requests(offset)
        passes_during = passes(op.metrics_port) - passes_before
    asked = Counter(what(r) for r in requests if r.get("verb") != "watch")
    # Not vacuous: the operator ran its passes all through the window (50 objects, every 10 s at least).
    assert passes_during >= OBJECTS * QUIET_S / 10 / 2, passes_during
    assert not asked, f"{passes_during:.0f} passes in a quiet {QUIET_S:.0f} s asked the API server for {dict(asked)}"
