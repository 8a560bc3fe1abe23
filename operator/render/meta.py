"""Metadata every child object carries: standard labels and an ownerReference to the Loom object."""

from __future__ import annotations

from typing import Any

PART_OF = "loom"
MANAGED_BY = "loom-operator"


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """ownerReference so deleting the Loom object garbage-collects its children."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(owner: dict[str, Any], component: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """app.kubernetes.io/* labels plus loom.dev/<kind> = owner name, for selectors and `kubectl get -l`."""
    kind = owner["kind"].lower()
    result = {
        "app.kubernetes.io/name": kind,
        "app.kubernetes.io/instance": owner["metadata"]["name"],
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"loom.dev/{kind}": owner["metadata"]["name"],
    }
    result.update(extra or {})
    return result


def child_metadata(
    owner: dict[str, Any],
    name: str,
    component: str,
    *,
    extra_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels(owner, component, extra_labels),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def restricted_security_context() -> dict[str, Any]:
    """Container security context: non-root, no privilege escalation, no capabilities."""
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
