"""Kueue's Workload API (kueue.x-k8s.io/v1beta2) as Loom speaks it, for any kind Kueue queues (pure).

Loom's kinds are Kueue "external frameworks" (Kueue's configuration `integrations.externalFrameworks`): Kueue's
own controllers queue, admit, preempt and account quota; the owner of a job (Loom) creates the job's Workload,
starts the job's pods only once the Workload is admitted, and answers Kueue's two requests to a job controller:
- eviction (condition Evicted=True: preempted, a quota change, a waitForPodsReady timeout): stop the pods, then
  release the quota by clearing `status.admission` (QuotaReserved=False, Admitted=False, Requeued);
- the job finished: condition Finished=True, so the quota goes back to the queue.
Those two writes are the same ones Kueue's built-in job integrations make (pkg/controller/jobframework), so
Kueue treats a Loom job as one of its own. This module renders the Workload, reads it into a small view, and
builds those two status changes; job.py decides from them, io.py does the I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime

from ..kit import Manifest, child_metadata, format_time, parse_time

GROUP = "kueue.x-k8s.io"
# Named apart from Loom's own API_VERSION (core/model.py): a module may need both.
KUEUE_API_VERSION = f"{GROUP}/v1beta2"
# The label a user puts on a job to queue it (Kueue's own convention for every integration).
QUEUE_LABEL = f"{GROUP}/queue-name"
# A WorkloadPriorityClass by name (Kueue's convention); else the pods' PriorityClass gives the priority.
PRIORITY_CLASS_LABEL = f"{GROUP}/priority-class"
JOB_UID_LABEL = f"{GROUP}/job-uid"

# Workload condition types and reasons (Kueue's apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
REQUEUED = "Requeued"
FINISHED = "Finished"
# Evictions after which Kueue's own integrations mark the Workload Requeued=True (it goes back to its queue
# at once); after the others (a waitForPodsReady timeout, a stopped queue) Kueue decides when it requeues.
REQUEUE_AT_ONCE = frozenset({"Preempted", "NodeFailures"})


def queue_name(metadata: Manifest) -> str | None:
    """The LocalQueue a job asks for (its `kueue.x-k8s.io/queue-name` label), or None: not queued by Kueue."""
    value = (metadata.get("labels") or {}).get(QUEUE_LABEL)
    return str(value) if value else None


def workload_name(kind: str, name: str, uid: str, part: str = "") -> str:
    """Deterministic (a re-run finds the same Workload) and unique per job incarnation (a job deleted and created
    again under the same name gets a new Workload): `<kind>-<name>-<5 hex of the uid>`, within a DNS label. `part`
    names one of several Workloads of one object (an InferenceService's scale steps): `...-<hex>-<part>`."""
    suffix = hashlib.sha256(uid.encode()).hexdigest()[:5] + (f"-{part}" if part else "")
    prefix = f"{kind.lower()}-{name}"[: 63 - len(suffix) - 1].rstrip("-")
    return f"{prefix}-{suffix}"


@dataclass(frozen=True)
class PodSet:
    """One group of identical pods: `count` of them, each asking for what `template` asks for. `min_count`
    (Kueue's partial admission) lets Kueue admit fewer, down to that many, when quota is short."""

    name: str
    count: int
    template: Manifest
    min_count: int | None = None

    def to_wire(self) -> Manifest:
        wire: Manifest = {"name": self.name, "count": self.count, "template": self.template}
        if self.min_count is not None and self.min_count < self.count:
            wire["minCount"] = self.min_count
        return wire


def pod_template(pod: Manifest) -> Manifest:
    """What Kueue needs of a pod to account and place it: each container's requests (limits stand in for missing
    requests, as the API server defaults them), node selector, tolerations, priority class. Nothing else: the
    Workload is an accounting record, not a way to start pods, and env or volumes would only leak into it."""
    spec = pod.get("spec") or {}
    template_spec: Manifest = {"containers": [_container(c) for c in spec.get("containers") or []]}
    if spec.get("initContainers"):
        template_spec["initContainers"] = [_container(c) for c in spec["initContainers"]]
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        if spec.get(key):
            template_spec[key] = spec[key]
    return {"spec": template_spec}


def _container(container: Manifest) -> Manifest:
    resources = container.get("resources") or {}
    requests = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    wire: Manifest = {"name": container["name"], "image": container.get("image") or "none"}
    if requests:
        wire["resources"] = {"requests": {k: str(v) for k, v in requests.items()}}
    return wire


@dataclass(frozen=True)
class Priority:
    """Where the Workload's priority comes from and its value (the controller reads the class's value)."""

    kind: str  # "WorkloadPriorityClass" (kueue.x-k8s.io) or "PriorityClass" (scheduling.k8s.io)
    name: str
    value: int

    def to_wire(self) -> Manifest:
        group = GROUP if self.kind == "WorkloadPriorityClass" else "scheduling.k8s.io"
        return {"priorityClassRef": {"group": group, "kind": self.kind, "name": self.name}, "priority": self.value}


def workload(
    owner: Manifest,
    queue: str,
    pod_sets: list[PodSet],
    priority: Priority | None = None,
    *,
    part: str = "",
    extra_labels: dict[str, str] | None = None,
) -> Manifest:
    """The Workload of a job: owned by it (controller reference: Kueue finds the job by it, and deleting the job
    deletes the Workload), in the job's LocalQueue, with the job's pod sets. `part` and `extra_labels` tell one of
    several Workloads of one object apart (workload_name)."""
    meta = owner["metadata"]
    metadata = child_metadata(
        owner,
        workload_name(owner["kind"], meta["name"], meta["uid"], part),
        "workload",
        extra_labels={JOB_UID_LABEL: meta["uid"], **(extra_labels or {})},
    )
    spec: Manifest = {"queueName": queue, "podSets": [p.to_wire() for p in pod_sets]}
    if priority is not None:
        spec |= priority.to_wire()
    return {"apiVersion": KUEUE_API_VERSION, "kind": "Workload", "metadata": metadata, "spec": spec}


@dataclass(frozen=True)
class Assignment:
    """What Kueue admitted of one pod set: how many pods, and the ResourceFlavor of each resource."""

    name: str
    count: int | None
    flavors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Eviction:
    reason: str
    message: str
    since: datetime | None


@dataclass(frozen=True)
class WorkloadView:
    """A Workload as a job controller needs it."""

    name: str
    uid: str
    resource_version: str
    quota_reserved: bool
    admitted: bool
    cluster_queue: str | None
    assignments: tuple[Assignment, ...]
    eviction: Eviction | None  # Evicted=True: Kueue wants the job's pods stopped
    finished: bool
    # Why it waits (QuotaReserved=False's message, e.g. "insufficient unused quota for nvidia.com/gpu ...").
    waiting: str
    conditions: tuple[Manifest, ...] = ()

    def assignment(self, name: str) -> Assignment | None:
        return next((a for a in self.assignments if a.name == name), None)


def _conditions(body: Manifest) -> list[Manifest]:
    return [dict(c) for c in (body.get("status") or {}).get("conditions") or []]


def _true(conditions: list[Manifest], kind: str) -> Manifest | None:
    return next((c for c in conditions if c.get("type") == kind and c.get("status") == "True"), None)


def observe_workload(body: Manifest) -> WorkloadView:
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    conditions = _conditions(body)
    admission = status.get("admission") or {}
    assignments = tuple(
        Assignment(
            name=str(a.get("name") or "main"),
            count=a.get("count") if isinstance(a.get("count"), int) else None,
            flavors={str(k): str(v) for k, v in (a.get("flavors") or {}).items()},
        )
        for a in admission.get("podSetAssignments") or []
    )
    evicted = _true(conditions, EVICTED)
    reserved = next((c for c in conditions if c.get("type") == QUOTA_RESERVED), None)
    return WorkloadView(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        quota_reserved=_true(conditions, QUOTA_RESERVED) is not None and bool(admission),
        admitted=_true(conditions, ADMITTED) is not None and bool(admission),
        cluster_queue=admission.get("clusterQueue"),
        assignments=assignments,
        eviction=Eviction(
            reason=str(evicted.get("reason") or "Evicted"),
            message=str(evicted.get("message") or ""),
            since=parse_time(evicted.get("lastTransitionTime")),
        )
        if evicted is not None
        else None,
        finished=_true(conditions, FINISHED) is not None,
        waiting=str(reserved.get("message") or "") if reserved is not None and reserved.get("status") != "True" else "",
        conditions=tuple(conditions),
    )


@dataclass(frozen=True)
class FlavorView:
    """A ResourceFlavor's placement: the node labels and tolerations a pod admitted on it gets."""

    name: str
    node_labels: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Manifest, ...] = ()


def observe_flavor(body: Manifest) -> FlavorView:
    spec = body.get("spec") or {}
    return FlavorView(
        name=str((body.get("metadata") or {}).get("name", "")),
        node_labels={str(k): str(v) for k, v in (spec.get("nodeLabels") or {}).items()},
        tolerations=tuple(dict(t) for t in spec.get("tolerations") or []),
    )


def place(pod: Manifest, flavors: list[FlavorView]) -> Manifest:
    """The pod with its admitted flavors' node labels (as nodeSelector terms) and tolerations added, as Kueue's own
    integrations do when they start an admitted job. The pod's own selector wins on a key both set (Kueue only
    admits a flavor whose labels agree with it)."""
    spec = dict(pod["spec"])
    selector: dict[str, str] = {}
    tolerations: list[Manifest] = list(spec.get("tolerations") or [])
    for flavor in flavors:
        selector.update(flavor.node_labels)
        tolerations += [t for t in flavor.tolerations if t not in tolerations]
    selector.update(spec.get("nodeSelector") or {})
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    return {**pod, "spec": spec}


def _set(conditions: list[Manifest], new: Manifest, now: datetime, generation: int | None) -> list[Manifest]:
    """Kubernetes' SetStatusCondition: lastTransitionTime moves only when the status changes."""
    stamped = {**new, "lastTransitionTime": format_time(now)}
    if generation is not None:
        stamped["observedGeneration"] = generation
    out, found = [], False
    for cond in conditions:
        if cond.get("type") != new["type"]:
            out.append(cond)
            continue
        found = True
        if cond.get("status") == new["status"]:
            stamped["lastTransitionTime"] = cond.get("lastTransitionTime") or stamped["lastTransitionTime"]
        out.append(stamped)
    if not found:
        out.append(stamped)
    return out


def release(view: WorkloadView, now: datetime, generation: int | None = None) -> Manifest:
    """The Workload status patch after an evicted job's pods are gone: quota released (no admission,
    QuotaReserved=False, Admitted=False) and Requeued, so Kueue queues it again. A merge patch guarded by the
    resourceVersion it was computed from: a Kueue write in between makes it fail, and the next pass recomputes."""
    eviction = view.eviction or Eviction("Evicted", "", None)
    conditions = list(view.conditions)
    conditions = _set(
        conditions,
        {
            "type": REQUEUED,
            "status": "True" if eviction.reason in REQUEUE_AT_ONCE else "False",
            "reason": eviction.reason,
            "message": eviction.message[:32768],
        },
        now,
        generation,
    )
    pending = {"status": "False", "reason": "Pending", "message": eviction.message[:32768]}
    conditions = _set(conditions, {"type": QUOTA_RESERVED, **pending}, now, generation)
    if any(c.get("type") == ADMITTED for c in conditions):
        admitted = {
            "type": ADMITTED,
            "status": "False",
            "reason": "NoReservation",
            "message": "The workload has no reservation",
        }
        conditions = _set(conditions, admitted, now, generation)
    return {
        "metadata": {"resourceVersion": view.resource_version},
        "status": {"admission": None, "conditions": conditions},
    }


def finish(view: WorkloadView, succeeded: bool, message: str, now: datetime, generation: int | None = None) -> Manifest:
    """The Workload status patch once the job finished: Finished=True gives its quota back to the queue."""
    condition = {
        "type": FINISHED,
        "status": "True",
        "reason": "Succeeded" if succeeded else "Failed",
        "message": message[:32768],
    }
    return {
        "metadata": {"resourceVersion": view.resource_version},
        "status": {"conditions": _set(list(view.conditions), condition, now, generation)},
    }


def describe_flavors(assignments: tuple[Assignment, ...]) -> str | None:
    """The admitted flavors for a status line: `gpu-a100` or `cpu-pool,gpu-a100`."""
    names = sorted({f for a in assignments for f in a.flavors.values()})
    return ",".join(names) or None


# Kueue's visibility API (VisibilityOnDemand, an aggregated API served by Kueue's manager): the pending workloads of
# a LocalQueue, in the order Kueue will consider them. Not served when the feature or its APIService is off.
VISIBILITY_API_VERSION = "visibility.kueue.x-k8s.io/v1beta2"
PENDING_WORKLOADS = "pendingworkloads"


@dataclass(frozen=True)
class Position:
    """Where a pending Workload stands, 1 = the next one Kueue considers (Kueue itself counts from 0)."""

    cluster_queue: int
    local_queue: int


def pending_positions(summary: Manifest | None) -> dict[str, Position]:
    """A LocalQueue's PendingWorkloadsSummary read into {workload name: position}; {} when none was served."""
    out: dict[str, Position] = {}
    for item in (summary or {}).get("items") or []:
        name = (item.get("metadata") or {}).get("name")
        in_cq, in_lq = item.get("positionInClusterQueue"), item.get("positionInLocalQueue")
        if isinstance(name, str) and isinstance(in_cq, int) and isinstance(in_lq, int):
            out[name] = Position(cluster_queue=in_cq + 1, local_queue=in_lq + 1)
    return out
