"""An InferenceService queued by Kueue (pure): its Workloads, and how many replicas admission lets it run.

A service labelled `kueue.x-k8s.io/queue-name` is a Kueue external framework like a TrainingJob
(trainingjob/queue/, core/queue/), with one difference: it changes size while it runs. How it is admitted:
- Its minimum (autoscaling.minReplicas, at least 1; or spec.replicas when not autoscaled) is one Workload with one
  pod set of that many replicas, admitted whole: no replica runs before it is admitted.
- Each replica above the minimum is a Workload of its own, a "scale step" of one replica (`...-s1`, `-s2`, ...),
  created when the autoscaler asks for it and deleted (its quota freed) when it scales back down. A step is
  admitted (or preempted) on its own, so a service under contention keeps its minimum and loses only the
  replicas it added; Kueue accounts them in the same queue with the same priority. Steps are pinned to the
  minimum's flavor (its node labels in their pod template: Kueue only admits a flavor that agrees), because one
  Deployment runs every replica from one pod template.
  Why not Kueue's elastic workload slices (ElasticJobsViaWorkloadSlices): an alpha feature gate, off by default,
  and built for Kueue's own job integrations (its job reconciler replaces a slice by a bigger one); an external
  framework would have to reimplement that protocol, and a slice is preempted whole, minimum included.
- The replicas the service runs are min(what the autoscaler asks, what Kueue admitted). What it asks and was not
  admitted is reported (status.queue, condition ScaleAdmitted=False WaitingForQuota, an event), never silently
  dropped; those steps stay queued and start when admitted.
- Evicted (preemption, a quota change): the evicted Workload's replicas are scaled away, then its quota is
  released and it is requeued (serving replicas hold no state to checkpoint). The minimum evicted stops the whole
  service (its steps are deleted: they were pinned to that admission's flavor) until it is readmitted.
- The minimum changed (minReplicas, or replicas when not autoscaled): Kueue does not resize an admitted Workload,
  so the service stops and its Workload is replaced and queued again.
- A replica larger than one pod (spec.vllm.parallelism.podsPerReplica, a LeaderWorkerSet group: llm/multinode.py)
  counts its pods: the minimum's pod set is minimum x podsPerReplica pods and a step's podsPerReplica, so a group is
  admitted whole (a gang) or not at all; replicas are still counted in groups.
- A disaggregated service (spec.vllm.disaggregation: llm/disaggregation.py) serves only with both its pools, which
  have fixed replicas: its minimum is one "replica" whose pod set is both pools' pods (prefill + decode), admitted
  whole or not at all; not admitted, neither pool runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ....core.kit import Condition, Event, Manifest, condition_events, set_condition
from ....core.queue import workload as kueue
from ....core.queue.job import Gate, QueueObservation, admission
from ....core.queue.workload import Eviction
from ..api import InferenceServiceSpec, InferenceServiceStatus
from ..llm.disaggregation import disaggregation
from ..llm.multinode import pods_per_replica
from .api import ServiceQueueStatus

POD_SET = "replicas"
STEP_LABEL = "loom.dev/scale-step"  # on a scale step's Workload: which step (1, 2, ...); absent on the minimum's



def minimum(spec: InferenceServiceSpec) -> int:
    """Replicas admitted as one pod set: minReplicas (at least 1: a service allowed to reach zero still holds quota
    for one replica, so it can come back without queueing), or the fixed replicas when not autoscaled."""
    if spec.autoscaling is not None:
        return max(1, spec.autoscaling.min_replicas)
    return max(1, 1 if spec.replicas is None else spec.replicas)


def minimum_pods(spec: InferenceServiceSpec) -> int:
    """The minimum's pod set count: its replicas times the pods of one replica (a group is admitted whole); a
    disaggregated service's, both pools' pods (the two are admitted together)."""
    if (split := disaggregation(spec)) is not None:
        return split.prefill.replicas + split.decode.replicas
    return minimum(spec) * pods_per_replica(spec)


def step_part(step: int) -> str:
    return f"s{step}"


def workloads(
    owner: Manifest,
    spec: InferenceServiceSpec,
    pod: Manifest,
    queue: str,
    create: tuple[int, ...],
    flavors: list[kueue.FlavorView],
    priority: kueue.Priority | None = None,
) -> list[Manifest]:
    """The Workloads to create: 0 is the minimum's, k >= 1 scale step k's (pinned to `flavors`). `pod` is the
    rendered Deployment's pod template, so what Kueue accounts is what every replica asks for."""
    out: list[Manifest] = []
    for step in create:
        if step == 0:
            pod_set = kueue.PodSet(POD_SET, minimum_pods(spec), kueue.pod_template(pod))
            out.append(kueue.workload(owner, queue, [pod_set], priority))
        else:
            pinned = kueue.PodSet(POD_SET, pods_per_replica(spec), kueue.pod_template(kueue.place(pod, flavors)))
            labels = {STEP_LABEL: str(step)}
            out.append(kueue.workload(owner, queue, [pinned], priority, part=step_part(step), extra_labels=labels))
    return out


@dataclass(frozen=True)
class ServiceQueue:
    """The service's LocalQueue and Workloads as Kueue left them."""

    name: str
    base: kueue.WorkloadView | None  # the minimum's Workload (None: not created yet)
    base_count: int | None = None  # its pod set's count, as created
    steps: dict[int, kueue.WorkloadView] = field(default_factory=dict)
    flavors: dict[str, kueue.FlavorView] = field(default_factory=dict)  # those of the minimum's admission
    position: kueue.Position | None = None  # the minimum's, while pending (visibility API)

    @property
    def minimum(self) -> QueueObservation:
        """The minimum's Workload as every queued kind's is observed (core/queue/job.py)."""
        return QueueObservation(self.name, self.base, self.flavors, self.position)

    def admitted_flavors(self) -> list[kueue.FlavorView]:
        return self.minimum.admitted_flavors(POD_SET)


def observe(name: str, bodies: list[Manifest], base_name: str) -> tuple[kueue.WorkloadView | None, int | None,
                                                                       dict[int, kueue.WorkloadView]]:  # fmt: skip
    """The service's Workloads (listed by its uid label) sorted into the minimum's and the steps by number."""
    base, count, steps = None, None, {}
    for body in bodies:
        view = kueue.observe_workload(body)
        step = ((body.get("metadata") or {}).get("labels") or {}).get(STEP_LABEL)
        if view.name == base_name:
            base = view
            pod_sets = (body.get("spec") or {}).get("podSets") or []
            count = pod_sets[0].get("count") if pod_sets and isinstance(pod_sets[0].get("count"), int) else None
        elif step is not None and str(step).isdigit():
            steps[int(step)] = view
    return base, count, steps


@dataclass(frozen=True)
class Minimum:
    """The service's minimum replicas as what Kueue's generic admission reads (core/queue/job.py's Admittable): one
    pod set, admitted whole. Admission's consequences for the replicas are `Admission`'s (below), not run/stop hooks."""

    spec: InferenceServiceSpec
    running: int  # replicas the service's Deployments run now
    pod_set: str = POD_SET

    def requested(self) -> int:
        return minimum_pods(self.spec)

    def active(self) -> int:
        return self.running

    def describe_eviction(self, eviction: Eviction, active: int, *, force: bool) -> str:
        why = f"{eviction.reason}: {eviction.message}".strip(": ")
        return f"{why}; stopping {active} replica(s)" if active else why


@dataclass(frozen=True)
class Admission:
    """What Kueue's admission lets the service run now, and the Workload writes that follow."""

    state: Literal["Queued", "Admitted", "Evicting"]
    replicas: int  # replicas that may run (across the stable and canary tracks)
    requested: int
    admitted: int = 0  # replicas Kueue admitted and did not evict
    create: tuple[int, ...] = ()  # Workloads to create: 0 the minimum's, k step k
    delete: tuple[str, ...] = ()  # Workloads to delete (their quota freed)
    release: tuple[kueue.WorkloadView, ...] = ()  # evicted and their replicas gone: release the quota, requeue
    queued_steps: int = 0
    evicted_steps: tuple[str, ...] = ()  # steps Kueue evicts now (their replicas are being scaled away)
    message: str = ""

    @property
    def limited(self) -> bool:
        """The autoscaler asks for more than runs because Kueue did not admit it."""
        return self.replicas < self.requested


def admit(obs: ServiceQueue, spec: InferenceServiceSpec, requested: int, running: int) -> Admission:
    """`requested`: the replicas the spec and the autoscaler want (clamped to min/max); `running`: the replicas the
    service's Deployments run now (their status.replicas)."""
    base, base_n = obs.base, minimum(spec)
    all_steps = tuple(s.name for _, s in sorted(obs.steps.items(), reverse=True))
    where = f"LocalQueue {obs.name}"
    if base is not None and obs.base_count is not None and obs.base_count != minimum_pods(spec):
        message = f"minimum changed from {obs.base_count} to {minimum_pods(spec)} pod(s): its Workload is replaced"
        gone = (base.name, *all_steps) if running == 0 else all_steps
        return Admission("Queued", 0, requested, delete=gone, message=message)
    gate: Gate = admission(obs.minimum, Minimum(spec, running))
    if base is None or gate.state != "Admitted":
        # Not created, evicted (its replicas stop, then its quota is released) or not admitted (any more): the
        # steps were pinned to an admission that is gone (or never was), so they go; they are asked for again.
        first = (0,) if gate.create_workload else ()
        freed = (base,) if gate.release and base is not None else ()
        return Admission(gate.state, 0, requested, create=first, delete=all_steps, release=freed,
                         message=gate.message)  # fmt: skip
    needed = max(0, requested - base_n)
    admitted, create, queued, waiting = base_n, [], 0, ""
    evicted: list[kueue.WorkloadView] = []
    for step in range(1, needed + 1):
        view = obs.steps.get(step)
        if view is None:
            create.append(step)
            queued += 1
        elif view.eviction is not None and view.quota_reserved:
            evicted.append(view)
            queued += 1
        elif view.admitted:
            admitted += 1
        else:
            queued += 1
            waiting = waiting or view.waiting
    extra = tuple(s.name for k, s in sorted(obs.steps.items(), reverse=True) if k > needed)
    replicas = min(requested, admitted)
    # An evicted step's quota goes back once the replicas above what stays admitted are gone.
    release = tuple(evicted) if evicted and running <= replicas else ()
    message = ""
    if queued:
        message = f"{queued} scale step(s) of {requested - base_n} waiting in {where}"
        message += f": {waiting}" if waiting else ""
    return Admission(
        "Admitted", replicas, requested, admitted=admitted, create=tuple(create), delete=extra, release=release,
        queued_steps=queued, evicted_steps=tuple(v.name for v in evicted), message=message,
    )  # fmt: skip


def report(
    adm: Admission, obs: ServiceQueue, previous: ServiceQueueStatus | None
) -> tuple[ServiceQueueStatus, list[tuple[bool, str, str, str]]]:
    """status.queue, and the conditions (ok, type, reason, message): Admitted (the minimum) and ScaleAdmitted
    (everything the autoscaler asks for runs; False WaitingForQuota names what waits and why)."""
    base = obs.base
    old = previous or ServiceQueueStatus()
    admitted = adm.state == "Admitted" and base is not None
    status = ServiceQueueStatus(
        name=obs.name,
        workload=base.name if base is not None else None,
        state=adm.state,
        cluster_queue=base.cluster_queue if admitted and base is not None else None,
        flavor=kueue.describe_flavors(base.assignments) if admitted and base is not None else None,
        requested_replicas=adm.requested,
        admitted_replicas=adm.admitted,
        queued_steps=adm.queued_steps,
        position=obs.position.cluster_queue if obs.position is not None and adm.state == "Queued" else None,
        message=adm.message or None,
        evictions=old.evictions + (1 if adm.state == "Evicting" and old.state != "Evicting" else 0),
    )
    if admitted:
        where = f"ClusterQueue {status.cluster_queue} on flavor {status.flavor or '-'}"
        gate = (True, "Admitted", "Admitted", f"{adm.admitted} replica(s) admitted by {where}")
    else:
        gate = (False, "Admitted", adm.state, adm.message)
    if not adm.limited:
        scale = (True, "ScaleAdmitted", "Admitted", f"all {adm.requested} requested replica(s) admitted")
    else:
        waiting = f"asks for {adm.requested} replica(s), Kueue admitted {adm.replicas}"
        reason = "WaitingForQuota" if admitted else adm.state
        scale = (False, "ScaleAdmitted", reason, f"{waiting}: {adm.message}" if adm.message else waiting)
    return status, [gate, scale]


CONDITIONS = ("Admitted", "ScaleAdmitted")
WARNING_REASONS = frozenset({"Evicting", "WaitingForQuota"})


def report_status(
    status: InferenceServiceStatus,
    adm: Admission,
    obs: ServiceQueue,
    previous: InferenceServiceStatus | None,
    generation: int | None,
) -> list[Event]:
    """Write status.queue and the two conditions into `status`; the events their transitions deserve."""
    queue, conditions = report(adm, obs, previous.queue if previous is not None else None)
    status.queue = queue
    old = list(status.conditions)
    new = old
    for ok, kind, reason, message in conditions:
        cond = Condition(
            type=kind, status="True" if ok else "False", reason=reason, message=message, observed_generation=generation
        )
        new = set_condition(new, cond)
    status.conditions = new
    before = [c for c in (previous.conditions if previous is not None else []) if c.type in CONDITIONS]
    return condition_events(before, [c for c in new if c.type in CONDITIONS], WARNING_REASONS)
