"""The reads and writes of Workloads that every kind queued by Kueue makes (thin I/O over core/client.py; the
decisions are in workload.py and job.py): a job's Workload and where it was admitted or waits, the priority it
gets, and the Workload writes a Gate asks for (create, release the quota, mark Finished)."""

from __future__ import annotations

import logging
from datetime import datetime

from .. import client as kube
from ..events import post_events
from ..kit import Event, Manifest
from .job import QueueObservation, WorkloadOwner
from .workload import (
    KUEUE_API_VERSION,
    PENDING_WORKLOADS,
    PRIORITY_CLASS_LABEL,
    VISIBILITY_API_VERSION,
    FlavorView,
    Position,
    Priority,
    WorkloadView,
    finish,
    observe_flavor,
    observe_workload,
    pending_positions,
    queue_name,
    release,
    workload_name,
)

log = logging.getLogger("loom.operator.kueue")


async def flavors(names: set[str]) -> dict[str, FlavorView]:
    """The named ResourceFlavors (cluster-scoped); one that is gone is left out."""
    out: dict[str, FlavorView] = {}
    for name in sorted(names):
        found = await kube.get(KUEUE_API_VERSION, "ResourceFlavor", None, name)
        if found is not None:
            out[name] = observe_flavor(found)
    return out


async def priority(labels: dict[str, str], pod_priority_class: str | None) -> Priority | None:
    """A WorkloadPriorityClass named by the kueue.x-k8s.io/priority-class label, else the pods' PriorityClass, as
    Kueue's own integrations take it; None when neither exists."""
    wanted = labels.get(PRIORITY_CLASS_LABEL)
    if wanted:
        found = await kube.get(KUEUE_API_VERSION, "WorkloadPriorityClass", None, wanted)
        if found is not None:
            return Priority("WorkloadPriorityClass", wanted, int(found.get("value", 0)))
    if pod_priority_class:
        found = await kube.get("scheduling.k8s.io/v1", "PriorityClass", None, pod_priority_class)
        if found is not None:
            return Priority("PriorityClass", pod_priority_class, int(found.get("value", 0)))
    return None


async def positions(namespace: str, local_queue: str) -> dict[str, Position]:
    """The LocalQueue's pending Workloads by name with their positions; {} when Kueue serves no visibility API
    (VisibilityOnDemand off, its APIService missing or unavailable): a position is a nicety, never a reason to fail
    a pass."""
    try:
        summary = await kube.get(
            VISIBILITY_API_VERSION, "LocalQueue", namespace, local_queue, subresource=PENDING_WORKLOADS
        )
    except kube.REQUEST_ERRORS as exc:
        log.debug("no queue positions for %s/%s: %s", namespace, local_queue, exc)
        return {}
    return pending_positions(summary)


async def observe(kind: str, job: Manifest) -> QueueObservation | None:
    """For a job labelled kueue.x-k8s.io/queue-name: its Workload (one per job, read by name), the flavors it was
    admitted on, and while it waits its position in the queue (when Kueue's visibility API answers)."""
    meta = job["metadata"]
    name = queue_name(meta)
    if name is None:
        return None
    wl_name = workload_name(kind, meta["name"], meta["uid"])
    body = await kube.get(KUEUE_API_VERSION, "Workload", meta["namespace"], wl_name)  # None: none, or no Kueue
    view = observe_workload(body) if body is not None else None
    admitted = await flavors({f for a in (view.assignments if view else ()) for f in a.flavors.values()})
    position = None
    if view is not None and not view.quota_reserved:  # only a waiting job has one: no read once admitted
        position = (await positions(meta["namespace"], name)).get(view.name)
    return QueueObservation(name, view, admitted, position)


async def create(owner: WorkloadOwner, queue: str, waiting: str) -> None:
    """Create the owner's Workload in `queue`, with the priority its labels or its pods' PriorityClass give it.
    Without Kueue's CRDs, an event says that `waiting` ("the job") waits until Kueue is installed."""
    labels = owner.body["metadata"].get("labels") or {}
    body = owner.workload(queue, await priority(labels, owner.priority_class()))
    await apply_workloads(owner.body, [body], waiting)


async def apply_workloads(owner: Manifest, workloads: list[Manifest], waiting: str) -> None:
    """Create rendered Workloads of `owner`; without Kueue's CRDs, the KueueMissing event instead."""
    try:
        for body in workloads:
            await kube.apply(body)
    except kube.NotFound:
        missing = f"{KUEUE_API_VERSION} Workload is not installed: {waiting} waits until Kueue is"
        post_events(owner, [Event("Warning", "KueueMissing", missing)])


async def release_quota(namespace: str, view: WorkloadView, now: datetime) -> None:
    """An evicted job whose pods are gone: its Workload's quota released and the Workload requeued."""
    await _write_status(namespace, view, release(view, now))


async def mark_finished(namespace: str, view: WorkloadView, succeeded: bool, message: str, now: datetime) -> None:
    """A finished job: its Workload Finished, which gives its quota back to the queue."""
    await _write_status(namespace, view, finish(view, succeeded, message, now))


async def _write_status(namespace: str, view: WorkloadView, patch: Manifest) -> None:
    """A status patch guarded by the resourceVersion it was computed from: Kueue writing in between makes it fail,
    and the next pass computes it again."""
    try:
        await kube.merge_patch(KUEUE_API_VERSION, "Workload", namespace, view.name, patch, subresource="status")
    except (kube.Conflict, kube.NotFound):
        log.info("Workload %s/%s changed meanwhile; the next pass writes it again", namespace, view.name)
