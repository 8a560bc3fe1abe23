"""Chaos: mixed Loom objects reconciled while the operator is SIGKILLed every few seconds (loom.e2e.chaos.churn).

The test scale is 12 objects and 3 kills (one of them during the deletion); `make chaos` runs 100 objects and 11.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.devstack.cluster import Cluster
from loom.e2e.chaos.churn import churn

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_objects_converge_to_the_calm_state_with_nothing_created_twice_and_no_orphans(
    cluster: Cluster, tmp_path: Path
) -> None:
    figures = churn(cluster, tmp_path, objects=12, kills=2, seed=15, interval_s=(1.5, 3.5))
    print(f"operator churn: {figures}")
    assert figures["problems"] == [], f"{figures}\noperator log: {tmp_path / 'operator-churn.log'}"
    assert figures["created_twice"] == {}
    assert figures["recreated_after_owner_deleted"] == {}
    assert figures["operator_kills"] == 3
    # Every object's children were seen being created (4 TrainingJobs alone have 2 pods, a Service and a ConfigMap
    # each), so the watch really saw the storm.
    assert figures["children_created"] >= 4 * 4
