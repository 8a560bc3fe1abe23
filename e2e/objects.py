"""Reading Loom's objects through kubectl in e2e tests, and waiting for one to reach a state: written once for the
tests that wait on several kinds (a FeatureView, the InferenceService it embeds with, the graph over both)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until


class HasLog(Protocol):
    """The test's operator (a host process, or the one installed by the chart): its last log lines."""

    def log_tail(self) -> str: ...


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    """The object, or {} when there is none."""
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def wait_for(
    cluster: Cluster,
    operator: HasLog,
    ns: str,
    kind: str,
    name: str,
    what: str,
    check: Callable[[dict[str, Any]], Any],
    *,
    timeout_s: float,
    interval_s: float = 2,
) -> dict[str, Any]:
    """The object once `check` holds for it; when it never does, an error with its status, the namespace's jobs and
    pods, and the operator's log tail."""

    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, kind, name)
        return obj if obj and check(obj) else None

    try:
        return dict(wait_until(done, timeout=timeout_s, what=f"{kind} {name}: {what}", interval=interval_s))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, kind, name).get("status"), indent=1)
        pods = cluster.kubectl("get", "jobs,pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\nstatus: {status}\n{pods}\n{operator.log_tail()}") from None
