"""The reads every kind queued by Kueue makes (thin I/O over core/client.py; the decisions are in core/kueue.py and
each kind's queueing.py): the ResourceFlavors a Workload was admitted on, the priority it gets, and where a pending
Workload stands in its queue (Kueue's visibility API, when Kueue serves it)."""

from __future__ import annotations

import logging

from . import client as kube
from . import kueue

log = logging.getLogger("loom.operator.kueue")


async def flavors(names: set[str]) -> dict[str, kueue.FlavorView]:
    """The named ResourceFlavors (cluster-scoped); one that is gone is left out."""
    out: dict[str, kueue.FlavorView] = {}
    for name in sorted(names):
        found = await kube.get(kueue.API_VERSION, "ResourceFlavor", None, name)
        if found is not None:
            out[name] = kueue.observe_flavor(found)
    return out


async def priority(labels: dict[str, str], pod_priority_class: str | None) -> kueue.Priority | None:
    """A WorkloadPriorityClass named by the kueue.x-k8s.io/priority-class label, else the pods' PriorityClass, as
    Kueue's own integrations take it; None when neither exists."""
    wanted = labels.get(kueue.PRIORITY_CLASS_LABEL)
    if wanted:
        found = await kube.get(kueue.API_VERSION, "WorkloadPriorityClass", None, wanted)
        if found is not None:
            return kueue.Priority("WorkloadPriorityClass", wanted, int(found.get("value", 0)))
    if pod_priority_class:
        found = await kube.get("scheduling.k8s.io/v1", "PriorityClass", None, pod_priority_class)
        if found is not None:
            return kueue.Priority("PriorityClass", pod_priority_class, int(found.get("value", 0)))
    return None


async def positions(namespace: str, local_queue: str) -> dict[str, kueue.Position]:
    """The LocalQueue's pending Workloads by name with their positions; {} when Kueue serves no visibility API
    (VisibilityOnDemand off, its APIService missing or unavailable): a position is a nicety, never a reason to fail
    a pass."""
    try:
        summary = await kube.get(
            kueue.VISIBILITY_API_VERSION, "LocalQueue", namespace, local_queue, subresource=kueue.PENDING_WORKLOADS
        )
    except kube.REQUEST_ERRORS as exc:
        log.debug("no queue positions for %s/%s: %s", namespace, local_queue, exc)
        return {}
    return kueue.pending_positions(summary)
