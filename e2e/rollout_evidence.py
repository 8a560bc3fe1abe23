"""What a test prints when a rollout does not settle: the Deployments' and ReplicaSets' own status counters and
what kube-controller-manager logged about the namespace.

A RolledOut condition waits for the Deployment controller (observedGeneration, updated, available); when it does
not come, the operator's log alone cannot tell a Deployment that never became available (the controller behind,
a pod never ready) from an operator that missed the Deployment's last event. These counters can.
"""

from __future__ import annotations

from typing import Any

from loom.devstack.cluster.paths import LOG_DIR

COUNTERS = (
    "NAME:.metadata.name,GEN:.metadata.generation,OBSERVED:.status.observedGeneration,WANT:.spec.replicas,"
    "REPLICAS:.status.replicas,UPDATED:.status.updatedReplicas,READY:.status.readyReplicas,"
    "AVAILABLE:.status.availableReplicas"
)


def rollout_evidence(cluster: Any, namespace: str, log_lines: int = 20) -> str:
    """Deployments' and ReplicaSets' counters in `namespace`, and kube-controller-manager's last lines about it."""
    parts = []
    for kind in ("deployments", "replicasets"):
        listed = cluster.kubectl("get", kind, "-n", namespace, "-o", f"custom-columns={COUNTERS}", check=False)
        parts.append(f"{kind}:\n{listed.stdout or listed.stderr}")
    controller_log = LOG_DIR / "kube-controller-manager.log"
    if controller_log.exists():
        lines = controller_log.read_text(errors="replace").splitlines()
        about = [line for line in lines if namespace in line][-log_lines:]
        parts.append("kube-controller-manager about it:\n" + ("\n".join(about) or "(nothing)"))
    return "\n".join(parts)
