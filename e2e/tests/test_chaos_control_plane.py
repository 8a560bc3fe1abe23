"""Chaos: the API server and etcd restarted while the operator reconciles (loom.e2e.chaos.control_plane): the same
operator and node agent processes carry on, objects created before and after become Ready, a new pod runs.

Marked `serial`: these restart the shared stack's components, so they run alone, never beside another test session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.devstack.cluster import Cluster
from loom.e2e.chaos.control_plane import api_server_and_etcd_restart

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]


def test_operator_and_node_agent_reconnect_after_api_server_and_etcd_restarts(
    cluster: Cluster, tmp_path: Path
) -> None:
    figures = api_server_and_etcd_restart(cluster, tmp_path)
    print(f"API server and etcd restart: {figures}")
    assert figures["problems"] == [], f"{figures}\noperator log: {tmp_path / 'operator-control-plane.log'}"
    assert figures["apiserver_restart_s"] > 0 and figures["etcd_restart_s"] > 0
