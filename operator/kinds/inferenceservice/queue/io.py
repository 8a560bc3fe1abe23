"""The reads and writes of a queued InferenceService's Workloads (thin I/O; the decisions are in queueing.py)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from ....core import client as kube
from ....core import kueue, kueue_io
from ....core.events import post_events
from ....core.kit import Event, Manifest
from ....core.reconcile import Pass
from ....defaults import Defaulted
from ..api import InferenceServiceSpec
from .admission import Admission, ServiceQueue, observe, workloads

log = logging.getLogger("loom.operator.inferenceservice")
KIND = "InferenceService"


async def observe_queue(owner: Manifest) -> ServiceQueue | None:
    """For a service labelled kueue.x-k8s.io/queue-name: its Workloads (one LIST by its uid label), the flavors its
    minimum was admitted on, and while that waits its position (when Kueue's visibility API answers)."""
    meta = owner["metadata"]
    name = kueue.queue_name(meta)
    if name is None:
        return None
    try:
        bodies = await kube.list_objects(
            kueue.API_VERSION, "Workload", meta["namespace"], f"{kueue.JOB_UID_LABEL}={meta['uid']}"
        )
    except kube.NotFound:  # Kueue is not installed: nothing is admitted, creating the Workload says so
        bodies = []
    base, count, steps = observe(name, bodies, kueue.workload_name(KIND, meta["name"], meta["uid"]))
    flavors = await kueue_io.flavors({f for a in (base.assignments if base else ()) for f in a.flavors.values()})
    position = None
    if base is not None and not base.quota_reserved:
        position = (await kueue_io.positions(meta["namespace"], name)).get(base.name)
    return ServiceQueue(name, base, count, steps, flavors, position)


async def act(
    owner: Manifest,
    labels: dict[str, str],
    spec: InferenceServiceSpec,
    adm: Admission,
    queue: ServiceQueue,
    pod: Manifest | None,
) -> None:
    """Create the Workloads admission asks for (`pod`: the rendered pod template; None, nothing to render yet),
    delete those no longer asked for, release the quota of evicted ones whose replicas are gone. `labels`: the
    service's own (a kueue.x-k8s.io/priority-class among them gives the Workloads' priority)."""
    namespace = owner["metadata"]["namespace"]
    if adm.create and pod is not None:
        priority = await kueue_io.priority(labels, None)
        try:
            for body in workloads(owner, spec, pod, queue.name, adm.create, queue.admitted_flavors(), priority):
                await kube.apply(body)
        except kube.NotFound:
            missing = f"{kueue.API_VERSION} Workload is not installed: the service waits until Kueue is"
            post_events(owner, [Event("Warning", "KueueMissing", missing)])
    for name in adm.delete:
        await kube.delete(kueue.API_VERSION, "Workload", namespace, name)
    now = datetime.now(UTC)
    for view in adm.release:
        try:
            await kube.merge_patch(
                kueue.API_VERSION, "Workload", namespace, view.name, kueue.release(view, now), subresource="status"
            )
        except (kube.Conflict, kube.NotFound):
            log.info("Workload %s/%s changed meanwhile; the next pass releases it", namespace, view.name)


async def act_on_queue(
    ctx: Pass[Defaulted[InferenceServiceSpec]], adm: Admission, queue: ServiceQueue, pod: Manifest | None
) -> None:
    assert ctx.spec is not None
    await act(ctx.owner, ctx.body["metadata"].get("labels") or {}, ctx.spec.spec, adm, queue, pod)
