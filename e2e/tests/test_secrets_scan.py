"""Secrets scan, run last in the session (issue 15): no S3 key or API key used by the tests appears in any log the
stack wrote, any event, any object's status or any ConfigMap.

Namespaces the tests deleted were scanned just before (loom.e2e.secrets_scan.record_namespace, called by the
namespace fixtures); what still exists is scanned here: every namespace's events, ConfigMaps and statuses, the
stack's component logs, the node agent's pod logs, and every log this session's operators wrote.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.paths import AGENT_STATE_DIR, LOG_DIR
from loom.e2e.secrets_scan import (
    KNOWN_SECRETS,
    SESSION,
    cluster_texts,
    log_texts,
    namespace_secrets,
    scan,
    take_shared_records,
)

# serial: `make test` runs it after the parallel e2e sessions ended, so it also reads what they left
# (loom.e2e.secrets_scan.finish_session).
pytestmark = [pytest.mark.core, pytest.mark.e2e, pytest.mark.serial, pytest.mark.timeout(300)]


def test_no_secret_in_logs_events_status_or_config_maps(
    cluster: Cluster, kube_api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    secrets = SESSION.secrets | KNOWN_SECRETS | namespace_secrets(kube_api)
    texts = list(cluster_texts(kube_api))
    logs = list(log_texts(LOG_DIR, AGENT_STATE_DIR / "logs", tmp_path_factory.getbasetemp()))
    others, other_namespaces, other_errors = take_shared_records()
    findings = [str(f) for f in SESSION.findings + scan(texts + logs, secrets)] + others
    print(
        f"[secrets scan] {len(secrets)} secret values; {SESSION.namespaces + other_namespaces} deleted namespaces "
        f"scanned before deletion (by this and {'earlier' if other_namespaces else 'no other'} sessions), now "
        f"{len(texts)} objects and {len(logs)} log files: {len(findings)} findings"
    )
    errors = SESSION.errors + other_errors
    assert not errors, errors[:5]
    assert not findings, findings[:20]
