"""What the autoscaling e2e tests and bench/bench_autoscale.py share: the GPU example pointed at the local stack,
reads of an InferenceService's autoscaling state, and the scale writes the operator logged (to the millisecond).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "inferenceservice-autoscale-gpu.yaml"


def get(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "inferenceservice", name, "-n", namespace, "-o", "json").stdout))


def autoscaled(obj: dict[str, Any]) -> dict[str, Any]:
    return dict((obj.get("status") or {}).get("autoscaling") or {})


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def example(namespace: str, s3: S3Endpoint, uri: str) -> dict[str, Any]:
    """The example as written, pointed at this stack's S3 and node agent, with the noop handler on CPU."""
    (obj,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    spec = obj["spec"]
    assert "replicas" not in spec  # the autoscaler's field
    spec["model"] = {"uri": uri, "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}}
    spec["handler"] = "noop"
    spec["gpus"] = 0
    spec["nodeSelector"] = {"kubernetes.io/hostname": AGENT_NODE_NAME}
    spec["env"] = [{"name": "AWS_DEFAULT_REGION", "value": s3.region}]
    spec["autoscaling"]["maxReplicas"] = 2  # two model servers on the agent are enough to show it
    spec["autoscaling"]["scaleDown"] = {"stabilizationWindowSeconds": 0}  # any wrong scale-down shows at once
    return dict(obj)


def ready_pods(cluster: Cluster, namespace: str, name: str) -> list[str]:
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}", "-o", "json").stdout
    )["items"]
    return sorted(
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    )


def pod_ip(cluster: Cluster, namespace: str, pod: str) -> str:
    return str(json.loads(cluster.kubectl("get", "pod", pod, "-n", namespace, "-o", "json").stdout)["status"]["podIP"])


@dataclass(frozen=True)
class ScaleWrite:
    at: float  # Unix time, from the operator log's local-time stamp
    reason: str  # ScaledUp, ScaledDown, ...
    before: int
    after: int
    # The decision's explanation, e.g. "metric 5 per replica over 1 ready, target 2" (what it decided on).
    message: str = ""

    @property
    def metric(self) -> float | None:
        """The metric value the decision was made on, read from `message`; None when it names none."""
        found = re.search(r"\bmetric ([-+0-9.e]+)", self.message)
        return float(found[1]) if found else None


def scale_writes(log: Path, namespace: str, name: str) -> list[ScaleWrite]:
    """Every replica write the builtin autoscaler logged for namespace/name, in order."""
    pattern = re.compile(rf"autoscaling {re.escape(namespace)}/{re.escape(name)}: (\w+) (\d+) -> (\d+): (.*)$")
    writes = []
    for line in log.read_text(errors="replace").splitlines():
        if found := pattern.search(line):
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            writes.append(ScaleWrite(at, found[1], int(found[2]), int(found[3]), found[4]))
    return writes


def direction_changes(writes: list[ScaleWrite]) -> int:
    """How often the direction of scaling reversed (up then down, or down then up)."""
    signs = [1 if w.after > w.before else -1 for w in writes if w.after != w.before]
    return sum(1 for a, b in itertools.pairwise(signs) if a != b)


def wait_for(
    cluster: Cluster,
    namespace: str,
    name: str,
    check: Callable[[dict[str, Any]], bool],
    what: str,
    *,
    timeout: float,
    context: Callable[[], str] = lambda: "",
) -> dict[str, Any]:
    """Poll the InferenceService until `check` holds; fail with its spec, status and `context()` otherwise."""

    def probe() -> dict[str, Any] | None:
        current = get(cluster, namespace, name)
        return current if check(current) else None

    try:
        return dict(wait_until(probe, timeout=timeout, what=what, interval=0.5))
    except TimeoutError as error:
        current = get(cluster, namespace, name)
        raise AssertionError(
            f"{error}\nspec.replicas={current['spec'].get('replicas')} "
            f"status={json.dumps(current.get('status'), indent=1)}\n{context()}"
        ) from None
