"""The render kit: what every kind's pure rendering and status code shares (no I/O).

A new kind's `kinds/<kind>/render.py` builds its children from these pieces, so every child object looks the same:

- `Manifest`: a Kubernetes object as a plain dict (what server-side apply sends).
- `owner_of(body, kind)`: the owner view of a Loom object; `child_metadata(owner, name, component)` gives a
  child its name, namespace, standard `app.kubernetes.io/*` labels and a controller ownerReference
  (deleting the Loom object garbage-collects it).
  `match_labels(owner, component)` selects what those labels mark (matchLabels, a Service's selector).
- `s3_env(credentials, endpoint)` and `merge_env(ours, user)`: S3 credentials as env by Secret reference
  (the operator never reads a Secret's data), and the user's variables layered over Loom's.
- `restricted_security_context()`: non-root, no privilege escalation, no capabilities.
- `cpu_threads_env(resources)`: OMP_NUM_THREADS from the CPU a container was given (PyTorch otherwise starts a
  thread per core of the node).
- Status: `Condition` / `set_condition` (Kubernetes conditions; lastTransitionTime moves only on a change),
  `Event` (what a state machine wants announced; the controller posts it), `condition_events(old, new, warnings)`
  (one event per condition that changed status or reason), `status_patch(old, new)` (the merge
  patch between two wire statuses), `format_time` / `parse_time` (RFC 3339, the one time format of status).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

from .model import (
    API_VERSION,
    Condition,
    EnvVar,
    Manifest,
    ResourceRequirements,
    S3Credentials,
    format_time,
    parse_time,
    set_condition,
)

__all__ = [
    "Condition",
    "Event",
    "Manifest",
    "child_metadata",
    "condition_events",
    "cpu_threads_env",
    "format_time",
    "labels",
    "match_labels",
    "merge_env",
    "owner_of",
    "owner_reference",
    "parse_time",
    "restricted_security_context",
    "s3_env",
    "set_condition",
    "status_patch",
]

PART_OF = "loom"
MANAGED_BY = "loom-operator"


# ------------------------------------------------------------------------------------------- metadata


def owner_of(body: Manifest, kind: str) -> Manifest:
    """The owner view every render function takes: apiVersion, kind and the identifying metadata of a Loom
    object (works on a raw body or a kopf Body turned dict)."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion") or API_VERSION,
        "kind": body.get("kind") or kind,
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
            "generation": meta.get("generation"),
        },
    }


def owner_reference(owner: Manifest) -> Manifest:
    """ownerReference so deleting the Loom object garbage-collects its children."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def controlled_by(child: Manifest, owner: Manifest) -> bool:
    """The child's controller ownerReference carries the owner's uid: an object of a name Loom gives may still be
    someone else's (another object whose own name ends like one of Loom's suffixes), and is then left alone."""
    uid = owner["metadata"].get("uid")
    refs = (child.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(r.get("controller") and r.get("uid") == uid for r in refs)


def taken_by(existing: Manifest | None, child: Manifest) -> Manifest | None:
    """The controller ownerReference of `existing`, an object of the child's name, when it names another object than
    the child's own controller: the name Loom derives (`<name>-decode`, `<name>-canary`, `<name>-picker`) is
    another object's child (e.g. the InferenceService named `<name>-decode`'s Deployment), and an apply under Loom's
    one field manager would take it over. None when absent, ours, nobody's, or a predecessor's (the same kind and
    name with an older uid: the object was deleted and made again, and the garbage collector is removing it)."""
    if existing is None:
        return None
    ours = next((r for r in child["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    theirs = next((r for r in (existing.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")),
                  None)  # fmt: skip
    if ours is None or theirs is None:
        return None
    if (theirs.get("kind"), theirs.get("name")) == (ours.get("kind"), ours.get("name")):
        return None
    return dict(theirs)


def match_labels(owner: Manifest, component: str) -> dict[str, str]:
    """The labels that pick one component's pods of one Loom object (a Deployment's matchLabels, a Service's
    selector): the first three of `labels`, so whatever `labels` marks they select, and another component never."""
    return {
        "app.kubernetes.io/name": owner["kind"].lower(),
        "app.kubernetes.io/instance": owner["metadata"]["name"],
        "app.kubernetes.io/component": component,
    }


def labels(owner: Manifest, component: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """app.kubernetes.io/* labels plus loom.dev/<kind> = owner name, for selectors and `kubectl get -l`."""
    kind = owner["kind"].lower()
    result = {
        **match_labels(owner, component),
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"loom.dev/{kind}": owner["metadata"]["name"],
    }
    result.update(extra or {})
    return result


def selector(match: Mapping[str, str]) -> str:
    """Labels as a selector string (`kubectl get -l` form): a scale subresource's selector, a LIST's filter."""
    return ",".join(f"{key}={value}" for key, value in sorted(match.items()))


def child_metadata(
    owner: Manifest,
    name: str,
    component: str,
    *,
    extra_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> Manifest:
    meta: Manifest = {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels(owner, component, extra_labels),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


# ------------------------------------------------------------------------------------------- containers


def restricted_security_context() -> Manifest:
    """Container security context: non-root, no privilege escalation, no capabilities."""
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def s3_env(credentials: S3Credentials | None, endpoint: str | None) -> list[Manifest]:
    """S3 access for boto3 and MLflow's artifact client: the keys by Secret reference, never by value."""
    env: list[Manifest] = []
    if credentials is not None:
        for var, key in (
            ("AWS_ACCESS_KEY_ID", credentials.access_key_id_key),
            ("AWS_SECRET_ACCESS_KEY", credentials.secret_access_key_key),
        ):
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": credentials.name, "key": key}}})
    if endpoint:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": endpoint})
        # MLflow artifact uploads and downloads go to the same object store with the same credentials.
        env.append({"name": "MLFLOW_S3_ENDPOINT_URL", "value": endpoint})
    return env


def merge_env(ours: list[Manifest], user: list[EnvVar] | None) -> list[Manifest]:
    """Loom's variables, then the user's; a user variable replaces Loom's of the same name. One entry per name:
    server-side apply rejects a container whose env repeats a name."""
    merged: dict[str, Manifest] = {item["name"]: item for item in ours}
    for var in user or []:
        merged.pop(var.name, None)
        merged[var.name] = var.to_wire()
    return list(merged.values())


def cpu_cores(quantity: int | str) -> float:
    """A CPU quantity as cores: 2, "2", "1.5", "500m"; raises ValueError on the suffixes CPU does not use."""
    text = str(quantity).strip()
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


# Kubernetes quantity suffixes: binary (Ki = 1024) and decimal (k = 1000, m = 1/1000).
_BINARY = {suffix: Decimal(1024) ** (power + 1) for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}
_DECIMAL = {"m": Decimal("0.001"), **{suffix: Decimal(1000) ** (power + 1) for power, suffix in enumerate("kMGTPE")}}


def memory_bytes(quantity: int | str) -> int | None:
    """A Kubernetes memory quantity in bytes (512Mi, 4Gi, 1G, 1e9, 268435456); None when it is not one."""
    text = str(quantity).strip()
    factor = Decimal(1)
    for suffixes in (_BINARY, _DECIMAL):
        suffix = next((s for s in suffixes if text.endswith(s)), None)
        if suffix is not None:
            text, factor = text[: -len(suffix)], suffixes[suffix]
            break
    try:
        value = Decimal(text) * factor
    except InvalidOperation:
        return None
    return int(value) if value.is_finite() and value > 0 else None


def cpu_threads_env(resources: ResourceRequirements | None) -> list[Manifest]:
    """OMP_NUM_THREADS for a container that runs PyTorch: its CPU limit, else its CPU request, rounded down and at
    least 1; 1 when it names no CPU.

    Why: OpenMP (PyTorch's intra-op pool) starts one thread per core of the node, not of the pod, and threads
    beyond the pod's CPU spin waiting for each other. Measured on a busy 2-core machine, a small model's training
    step took 7-10x the CPU time with 2 threads than with 1. torchrun sets 1 only when a pod runs several ranks.
    Put it before the user's variables (`merge_env`): a user's OMP_NUM_THREADS wins."""
    cpu: int | str | None = None
    if resources is not None:
        cpu = (resources.limits or {}).get("cpu") or (resources.requests or {}).get("cpu")
    try:
        threads = max(1, math.floor(cpu_cores(cpu))) if cpu is not None else 1
    except ValueError:
        threads = 1  # a valid quantity no one writes for CPU ("2k", "1Ki"): the pod gets what the scheduler gives
    return [{"name": "OMP_NUM_THREADS", "value": str(threads)}]


# ------------------------------------------------------------------------------------------- status


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event a state machine asks the controller to post on the object."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def condition_events(old: list[Condition], new: list[Condition], warnings: Collection[str]) -> list[Event]:
    """One event per condition whose status or reason changed (a stuck state is reported once, not forever); a
    Warning when its reason is in `warnings`."""
    before = {c.type: c for c in old}
    events: list[Event] = []
    for cond in new:
        prior = before.get(cond.type)
        if prior is not None and prior.status == cond.status and prior.reason == cond.reason:
            continue
        message = f"{cond.type}={cond.status}: {cond.message}"
        events.append(Event("Warning" if cond.reason in warnings else "Normal", cond.reason, message))
    return events


def status_patch(old: Manifest, new: Manifest) -> Manifest | None:
    """The merge patch turning status `old` into `new` (None when equal); cleared fields become null at any depth.
    A merge patch merges objects key by key, so a field left out of a nested object is kept, not cleared: the
    canary analysis' `stepStartedAt`, cleared when a step advanced, stayed, and every later step's pause counted
    from the first step's start (its e2e test saw the last step promoted about 20 s after it began, not 60)."""
    if old == new:
        return None
    return _merge_patch(old, new)


def _merge_patch(old: Manifest, new: Manifest) -> Manifest:
    patch: Manifest = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            patch[key] = _merge_patch(before, value)
        else:
            patch[key] = value  # lists and values are replaced whole, as a merge patch does
    return patch
