"""The audited operator's requests: what an operator running as the stack's audited identity (loom-audited-operator,
devstack/cluster/components.py: audit_policy) asked of the API server, read from the API server's audit log.
`apiserver_request_total` has no user label; the audit log names who asked. Used by the steady-state test and
bench/bench_steady_requests.py."""

from __future__ import annotations

import json
from typing import Any

from loom.devstack.cluster.components import AUDITED_USER
from loom.devstack.cluster.paths import AUDIT_LOG


def audit_offset() -> int:
    """Where the audit log ends now: requests logged after it are read by `operator_requests(offset)`."""
    return AUDIT_LOG.stat().st_size if AUDIT_LOG.exists() else 0


def operator_requests(since: int) -> list[dict[str, Any]]:
    """The audited operator's requests logged after byte `since` of the audit log (its completed requests)."""
    if not AUDIT_LOG.exists():
        return []
    with AUDIT_LOG.open("rb") as log:
        log.seek(since)
        events = [json.loads(line) for line in log.read().splitlines() if line.strip()]
    return [e for e in events if (e.get("user") or {}).get("username") == AUDITED_USER]


def what(event: dict[str, Any]) -> tuple[str, str]:
    """(verb, resource[/subresource]) of an audit event."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return event.get("verb", "?"), resource
