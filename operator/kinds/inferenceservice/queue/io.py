"""Kueue's edge and hooks for an InferenceService (QueueFeature): the reads and writes of a queued service's
Workloads (thin I/O; the decisions are in admission.py)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import kopf

from ....core import client as kube
from ....core.kit import Event, Manifest
from ....core.queue import io as queue_io
from ....core.queue import workload as kueue
from ..api import InferenceServiceSpec, InferenceServiceStatus
from ..feature import Draft, Feature, Observed, Plan, ServicePass
from ..render import Track, replica_pod_template
from .admission import Admission, ServiceQueue, admit, observe, report_status, workloads

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
            kueue.KUEUE_API_VERSION, "Workload", meta["namespace"], f"{kueue.JOB_UID_LABEL}={meta['uid']}"
        )
    except kube.NotFound:  # Kueue is not installed: nothing is admitted, creating the Workload says so
        bodies = []
    base, count, steps = observe(name, bodies, kueue.workload_name(KIND, meta["name"], meta["uid"]))
    flavors = await queue_io.flavors({f for a in (base.assignments if base else ()) for f in a.flavors.values()})
    position = None
    if base is not None and not base.quota_reserved:
        position = (await queue_io.positions(meta["namespace"], name)).get(base.name)
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
        priority = await queue_io.priority(labels, None)
        bodies = workloads(owner, spec, pod, queue.name, adm.create, queue.admitted_flavors(), priority)
        await queue_io.apply_workloads(owner, bodies, "the service")
    for name in adm.delete:
        await kube.delete(kueue.KUEUE_API_VERSION, "Workload", namespace, name)
    now = datetime.now(UTC)
    for view in adm.release:
        await queue_io.release_quota(namespace, view, now)


class QueueFeature(Feature):
    """Label kueue.x-k8s.io/queue-name: replicas run once Kueue admits them (the minimum, then scale steps)."""

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        seen.queue = await observe_queue(p.ctx.body)

    def decide(self, p: ServicePass, seen: Observed, draft: Draft) -> None:
        if seen.queue is None:
            return
        # What Kueue admitted caps the replicas; the rest waits, reported (admission.py).
        live = sum(max(int((d or {}).get("spec", {}).get("replicas", 0)), int((d or {}).get("status", {})
                       .get("replicas", 0))) for d in (seen.stable, seen.canary))  # fmt: skip
        draft.admission = admit(seen.queue, p.spec, draft.total, live)
        draft.total = draft.admission.replicas

    def render(self, p: ServicePass, seen: Observed, plan: Plan, track: Track, deployment: Manifest) -> None:
        placement = seen.queue.admitted_flavors() if seen.queue is not None else None
        if placement:  # on the admitted flavor's nodes
            deployment["spec"]["template"] = kueue.place(deployment["spec"]["template"], placement)

    async def after_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        if plan.admission is None or seen.queue is None:
            return
        # What a Workload accounts: one replica's pod template (none while no model resolves).
        ref = plan.rollout.stable_ref or seen.desired
        pod = None
        if ref is not None and plan.invalid is None:
            pod = replica_pod_template(p.ctx.owner, p.spec, ref, p.settings.server_image, seen.features,
                                       p.settings.vllm_image)  # fmt: skip
        await act(p.ctx.owner, p.ctx.body["metadata"].get("labels") or {}, p.spec, plan.admission, seen.queue, pod)

    def status(
        self, p: ServicePass, seen: Observed, plan: Plan, status: InferenceServiceStatus,
        previous: InferenceServiceStatus | None,
    ) -> list[Event]:
        if plan.admission is None or seen.queue is None:
            return []
        return report_status(status, plan.admission, seen.queue, previous, p.ctx.generation)

    def register(self, trigger: Callable[[str, str], Awaitable[None]]) -> None:
        # A queued service's Workloads: Kueue admitting or evicting one is a reason for a pass at once.
        @kopf.on.event(kueue.GROUP, "v1beta2", "workloads", labels={kueue.JOB_UID_LABEL: kopf.PRESENT})
        async def inferenceservice_workload_event(body: kopf.Body, **_: Any) -> None:
            for owner in body.metadata.get("ownerReferences") or []:
                if owner.get("kind") == KIND and owner.get("controller"):
                    await trigger(str(body.metadata.namespace), owner["name"])
