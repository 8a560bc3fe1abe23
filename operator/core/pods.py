"""A kind's child pods from the watch cache: a Kopf index instead of a LIST per pass (pure).

The render kit labels every child pod app.kubernetes.io/name=<kind label> and loom.dev/<kind label>=<owner name>;
runner.register_pod_index keeps those pods per (namespace, owner name), and `pods_of` picks the ones a pass needs by
their labels (a component's selector). Status reads the pods only to say why one cannot start (pod_problems), so
the watch cache's slight lag is harmless and a steady state issues no LIST.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .kit import Manifest

# (namespace, owner name) -> the owner's pods, as Kopf's index holds them (a live store of the bodies).
PodIndex = Mapping[tuple[str, str], Any]


def pods_of(index: PodIndex | None, namespace: str, owner: str, match: Mapping[str, str]) -> list[Manifest]:
    """The owner's pods whose labels include `match`, by name; none before the index is bound."""
    if index is None:
        return []
    found = [dict(pod) for pod in index.get((namespace, owner), ())]
    chosen = [pod for pod in found if match.items() <= ((pod.get("metadata") or {}).get("labels") or {}).items()]
    return sorted(chosen, key=lambda pod: str(pod["metadata"].get("name", "")))
