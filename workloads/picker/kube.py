"""The picker's view of the replicas: the activator's pod list+watch (loom.workloads.activator.kube.PodWatch),
published as Ready, not terminating pods with their endpoint, name and track.

Pods rather than the Service's EndpointSlices: the picker needs each replica's track label (the canary's share)
and its pod name (metrics), which an EndpointSlice does not carry, and the activator already watches these pods
with the same RBAC rule (list/watch pods). The readiness and terminating rules are the activator's
(`ready_endpoints`), so a draining replica gets nothing new from either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from loom.workloads.activator.kube import PodWatch
from loom.workloads.activator.targets import ready_endpoints

from .config import DisaggregationConfig
from .state import Pod


def ready_replicas(pods: Iterable[Mapping[str, Any]], port: int, track_label: str,
                   disaggregation: DisaggregationConfig | None = None) -> dict[str, Pod]:
    """endpoint -> Pod for every Ready pod with an IP that is not terminating (pure); with `disaggregation`, each
    with its role and kv-version labels."""
    out: dict[str, Pod] = {}
    for pod in pods:
        for endpoint in ready_endpoints([pod], port):
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            role = labels.get(disaggregation.role_label) if disaggregation else None
            version = labels.get(disaggregation.version_label) if disaggregation else None
            out[endpoint] = Pod(meta.get("name", endpoint), labels.get(track_label, "stable"), role, version)
    return out


class ReplicaWatch(PodWatch):
    track_label = "loom.dev/track"
    disaggregation: DisaggregationConfig | None = None

    def _push(self, pods: dict[str, Any]) -> None:
        self._publish(ready_replicas(pods.values(), self.config.target_port, self.track_label, self.disaggregation))
