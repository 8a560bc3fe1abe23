"""TrainingJob controller: its Reconciler on the skeleton (core/reconcile.py) around the pure state machine.

One reconcile = read the job fresh from the API server (status is the only memory), take worker pods and
nodes from Kopf's in-memory indexes (no list calls), create the MLflow run if needed, poll rank 0's
progress, run `decide`, write status FIRST, then act (apply children, delete pods) and post events.
Writing status before acting is what makes a crash at any instant harmless: the next reconcile repeats
idempotent actions (deterministic names, server-side apply, uid-guarded deletes) and never re-counts a
restart. Triggers: job create/update/resume, every worker pod event, and the periodic resync (deadlines, grace
periods, progress) of jobs that are not idle; the shared runner (runner.py) serialises, coalesces and bounds them.
A feature's reads and writes are its package's io.py (data/, finetune/, queue/, registration/, tracking/), called
from observe and apply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

import kopf

from ... import defaults as endpoint_defaults
from ...core import client as kube
from ...core.events import post_events
from ...core.kit import Event, set_condition
from ...core.leadership import LEADERSHIP
from ...core.model import Condition
from ...core.queue import workload as kueue
from ...core.queue.job import QueueObservation
from ...core.reconcile import Pass, previous_status, run
from ...core.runner import Indexes, Runner, own_kind_handlers
from ...settings import OperatorSettings
from . import render
from .api import TrainingJobSpec, TrainingJobStatus
from .config import SpecError, rendezvous_service_name
from .data.io import observe_training_data
from .data.retrieval import DataObservation
from .decision import Decision, Observation, Policy
from .expectations import CreatedWorkers
from .finetune.io import resolve_base_model
from .observe import NodeView, ProgressReport, WorkerView, observe_node, observe_pod
from .pacing import QUIET_S, steady
from .progress.io import Poll, ProgressPoller, rank0_poll
from .queue.io import act_on_workload, observe_queue
from .queue.workload import POD_SET
from .registration.io import register_when_due
from .state import decide
from .tracking.io import close_run, ensure_tracking

log = logging.getLogger("loom.trainingjob")

PLURAL = "trainingjobs"
FINISHED = ("Succeeded", "Failed")
POD_INDEX = "loom_training_pods"
NODE_INDEX = "loom_training_nodes"
JOB_INDEX = "loom_training_jobs"
# How long a worker pod's event waits for the others of its burst before the job's pass that reads them all.
WORKER_EVENTS_S = 0.25

PodIndex = kopf.Index[tuple[str, str], tuple[WorkerView, str | None]]
NodeIndex = kopf.Index[str, NodeView]


@dataclass
class Observed:
    """What a job's pass reads: its status as the last pass left it, its workers and their nodes (from Kopf's
    indexes), rank 0's progress, and the outcomes of the MLflow run and the training-data Job it started."""

    status: TrainingJobStatus
    observed: list[tuple[WorkerView, str | None]] = field(default_factory=list)
    nodes: dict[str, NodeView] = field(default_factory=dict)
    progress: ProgressReport | None = None
    spec_error: str | None = None
    endpoint_problem: str | None = None
    tracking_error: str | None = None
    training_data: DataObservation | None = None
    queue: QueueObservation | None = None
    base_wait: tuple[str, str] | None = None  # finetune's base model (another TrainingJob) is not there yet
    now: datetime = field(default_factory=lambda: datetime.now(UTC))
    rank0: Poll | None = None  # what the progress poller asks (rank 0, checkpoint URI, samples per step)
    observation: Observation | None = None  # what the state machine decided from (decide keeps it for pacing)

    @property
    def views(self) -> tuple[WorkerView, ...]:
        return tuple(v for v, _ in self.observed)

    @property
    def renders(self) -> bool:
        """Whether the job's children can be rendered: not without its endpoint or its base model (a later pass)."""
        return self.endpoint_problem is None and self.base_wait is None


@dataclass
class Controller:
    """The TrainingJob kind on the reconcile skeleton (core/reconcile.py). Its status goes first (`status_first`):
    a crash between the status write and the children is harmless, the next pass repeats the idempotent actions
    and never re-counts a restart. Creating the MLflow run and the training-data Job happen while observing:
    the decision needs their outcome."""

    kind: ClassVar[str] = "TrainingJob"
    status_model: ClassVar[type[Any]] = TrainingJobStatus
    status_first: ClassVar[bool] = True

    image: str
    policy: Policy
    features_image: str = ""
    defaults: endpoint_defaults.EndpointDefaults = field(default_factory=endpoint_defaults.EndpointDefaults)
    indexes: Indexes = field(default_factory=lambda: Indexes(POD_INDEX, NODE_INDEX))
    progress: ProgressPoller | None = None  # rank 0's progress, polled beside the passes (register() makes it)
    created: CreatedWorkers = field(default_factory=CreatedWorkers)  # pods created, not in the pod index yet
    # A steady job's periodic passes are skipped for this long (the runner's `quiet`; register() wires it).
    quiet: Callable[[str, str, float], None] | None = None

    def worker_views(self, namespace: str, name: str) -> list[tuple[WorkerView, str | None]]:
        pods: PodIndex | None = self.indexes.get(POD_INDEX)
        if pods is None:
            return []
        return list(pods.get((namespace, name), []))

    async def reconcile(self, namespace: str, name: str) -> None:
        await run(self, namespace, name)

    def parse(self, body: kube.Manifest) -> endpoint_defaults.Defaulted[TrainingJobSpec]:
        # The operator's endpoint defaults fill what the spec leaves unset, before anything renders or calls out.
        return endpoint_defaults.training_job(TrainingJobSpec.model_validate(body.get("spec") or {}), self.defaults)

    def check(self, body: kube.Manifest, spec: endpoint_defaults.Defaulted[TrainingJobSpec]) -> None:
        """Nothing here: a name or config the job cannot run with is the state machine's `spec_error` (Failed)."""

    async def observe(self, ctx: Pass[endpoint_defaults.Defaulted[TrainingJobSpec]]) -> Observed:
        namespace, name, job = ctx.namespace, ctx.name, ctx.body
        status = previous_status(TrainingJobStatus, job)
        if status is None:
            log.warning("TrainingJob %s/%s has an unreadable status; starting from an empty one", namespace, name)
            status = TrainingJobStatus()
        seen = Observed(status=status, observed=self.worker_views(namespace, name))
        if ctx.spec is None:
            return seen
        defaulted, spec = ctx.spec, ctx.spec.spec
        nodes: NodeIndex | None = self.indexes.get(NODE_INDEX)
        for view in seen.views:
            if view.node_name and nodes is not None and view.node_name in nodes:
                seen.nodes[view.node_name] = next(iter(nodes[view.node_name]))
        seen.endpoint_problem = defaulted.problem()
        seen.spec_error = render.name_problem(name, max(spec.workers.replicas, spec.workers.max_replicas or 0))
        if seen.spec_error is None and spec.finetune is not None:
            seen.spec_error, seen.base_wait = await resolve_base_model(ctx, status, self.defaults)
            spec = defaulted.spec
        if seen.spec_error is None and seen.endpoint_problem is None and seen.base_wait is None:
            try:
                render.config_map(job, spec)
            except SpecError as error:
                seen.spec_error = str(error)
        seen.tracking_error = None if seen.endpoint_problem else await ensure_tracking(job, spec, status)
        seen.rank0 = rank0_poll(spec, status, seen.observed)
        if self.progress is not None and seen.rank0 is not None:
            seen.progress = self.progress.latest((namespace, name), *seen.rank0)
        seen.queue = await observe_queue(job)
        data_built = status.training_data is not None and status.training_data.phase == "Succeeded"
        blocked = seen.spec_error is not None or seen.endpoint_problem is not None
        if not blocked and not data_built and status.phase not in FINISHED and not spec.run_policy.suspend:
            seen.training_data = await observe_training_data(job, spec, self.features_image, self.defaults)
        return seen

    def decide(self, ctx: Pass[endpoint_defaults.Defaulted[TrainingJobSpec]], seen: Observed) -> Decision | None:
        if ctx.spec is None:
            return None
        spec, status = ctx.spec.spec, seen.status
        seen.observation = observation = Observation(
            generation=ctx.generation,
            spec=spec,
            status=status,
            pods=seen.views,
            now=seen.now,
            nodes=seen.nodes,
            progress=seen.progress,
            tracking_ready=spec.tracking is None
            or spec.tracking.mlflow is None
            or bool(status.mlflow and status.mlflow.run_id),
            tracking_error=seen.tracking_error,
            spec_error=seen.spec_error,
            training_data=seen.training_data,
            endpoint_problem=seen.endpoint_problem,
            base_wait=seen.base_wait,
            queue=seen.queue,
        )
        decision = decide(observation, self.policy)
        decision.status.endpoint_defaults = ctx.spec.status_field()
        return decision

    def status(
        self,
        ctx: Pass[endpoint_defaults.Defaulted[TrainingJobSpec]],
        seen: Observed,
        decision: Decision | None,
        previous: TrainingJobStatus | None,
    ) -> tuple[TrainingJobStatus, Sequence[Event]]:
        if decision is not None:
            return decision.status, decision.events
        # A spec that does not validate: say why on Ready, keep the rest as it was.
        status = seen.status.model_copy()
        invalid = Condition(
            type="Ready", status="False", reason="InvalidSpec", message=ctx.invalid, observed_generation=ctx.generation
        )
        status.conditions = set_condition(list(status.conditions or []), invalid)
        return status, []

    async def prepare(
        self,
        ctx: Pass[endpoint_defaults.Defaulted[TrainingJobSpec]],
        seen: Observed,
        decision: Decision | None,
        *,
        owner_written: bool,
    ) -> None:
        """The rendezvous Service and the ConfigMap (and the PodGroup), while the status is written: they name no
        attempt. The pods, which do, wait for both (`apply`): a child the API server refuses (a role missing a
        rule) must keep the pods from being created (e2e test_helm_install). Applying the two children together
        saved a new job one round trip (P1: per-job p50 0.87-1.12 -> 0.51-0.71 s, bench/bench_kubeflow_p1.py),
        applying them beside the status another."""
        assert ctx.spec is not None and decision is not None
        if seen.renders and children_due(decision, spec_changed=seen.status.observed_generation != ctx.generation):
            await self.apply_children(ctx.body, ctx.spec.spec, owner_written=owner_written)

    async def apply(
        self, ctx: Pass[endpoint_defaults.Defaulted[TrainingJobSpec]], seen: Observed, decision: Decision | None
    ) -> Observed:
        assert ctx.spec is not None and decision is not None
        if not seen.renders:
            self.pace(ctx, seen, None)
            return seen
        spec, status = ctx.spec.spec, seen.status
        await self.act(ctx.body, spec, decision, seen.views, queue=seen.queue)
        if decision.status.phase in FINISHED and status.phase not in FINISHED:
            await close_run(spec, decision.status)
        await register_when_due(ctx.body, spec, decision.status)
        self.pace(ctx, seen, decision)
        return seen

    def pace(self, ctx: Pass[Any], seen: Observed, decision: Decision | None) -> None:
        """A steady job (pacing.py) leaves the periodic resync. The poller follows every job whose rank 0 runs, steady
        or not, so that status progress is within one training poll of the trainer's (#52): a job that is not steady
        would otherwise show the answer of the poll its previous pass started, up to two polls behind."""
        key = (ctx.namespace, ctx.name)
        calm = decision is not None and seen.observation is not None and steady(seen.observation, decision)
        if calm and self.quiet is not None:
            self.quiet(*key, QUIET_S)
        if self.progress is None:
            return
        if seen.rank0 is not None:
            self.progress.follow(key, *seen.rank0)
        else:
            self.progress.unfollow(key)

    async def act(
        self,
        job: kube.Manifest,
        spec: TrainingJobSpec,
        decision: Decision,
        views: tuple[WorkerView, ...],
        *,
        queue: QueueObservation | None = None,
    ) -> None:
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        status = decision.status
        if decision.create or decision.delete or decision.delete_children:
            log.info(
                "TrainingJob %s/%s %s: create workers %s, delete %s%s",
                namespace,
                name,
                status.phase,
                decision.create,
                [f"{d.name}{' (force)' if d.force else ''}" for d in decision.delete],
                ", delete children" if decision.delete_children else "",
            )
        # The Service and the ConfigMap were applied beside the status (`prepare`), before this.
        if queue is not None:
            await act_on_workload(job, spec, self.image, decision, queue)
        if decision.create:
            run_id = status.mlflow.run_id if status.mlflow else None
            pods = [
                render.worker_pod(job, spec, index, attempt=status.attempt, image=self.image, mlflow_run_id=run_id)
                for index in decision.create
            ]
            # A pod an earlier pass created that the index does not show yet is not applied again (expectations.py).
            expected = self.created.expected((namespace, name), [(v.name, v.attempt) for v in views], time.monotonic())
            pods = [pod for pod in pods if (pod["metadata"]["name"], status.attempt) not in expected]
            if queue is not None:  # admitted: on the admitted flavor's nodes
                pods = [kueue.place(pod, queue.admitted_flavors(POD_SET)) for pod in pods]
            made = await asyncio.gather(*(kube.create(pod) for pod in pods))  # created, never converged (client.create)
            # A namesake that exists already (the previous attempt's, terminating) is not this attempt's worker: not
            # expected, so the pass after its deletion creates the worker at once, not EXPECT_S later.
            created = [pod["metadata"]["name"] for pod, body in zip(pods, made, strict=True) if body is not None]
            self.created.created((namespace, name), [(pod, status.attempt) for pod in created], time.monotonic())
        deletes = [
            kube.delete("v1", "Pod", namespace, d.name, grace_period_seconds=0 if d.force else None, uid=d.uid)
            for d in decision.delete
        ]
        await asyncio.gather(*deletes)
        if decision.delete_children:
            self.created.forget((namespace, name))
            await asyncio.gather(
                *(kube.delete("v1", "Pod", namespace, v.name, uid=v.uid) for v in views),
                kube.delete("v1", "Service", namespace, rendezvous_service_name(name)),
                kube.delete("v1", "ConfigMap", namespace, render.config_map_name(name)),
            )
            group = render.pod_group(job, spec)
            if group is not None:
                await kube.delete(group["apiVersion"], "PodGroup", namespace, name)

    async def apply_children(self, job: kube.Manifest, spec: TrainingJobSpec, *, owner_written: bool) -> None:
        """Beside the status write (`prepare`); when one goes out, its answer is their owner check (kube.apply)."""
        service, config = render.headless_service(job), render.config_map(job, spec)
        await asyncio.gather(
            kube.apply(service, owner_written_beside=owner_written),
            kube.apply(config, owner_written_beside=owner_written),
        )
        group = render.pod_group(job, spec)
        if group is None:
            return
        try:
            await kube.apply(group)
        except kube.NotFound:
            # The gang scheduler's CRD is not installed: say so, and let the pods be scheduled without it.
            missing = Event("Warning", "GangSchedulerMissing", f"{group['apiVersion']} PodGroup is not installed")
            post_events(job, [missing])


def register(settings: OperatorSettings) -> None:
    controller = Controller(
        image=settings.trainer_image,
        policy=Policy(node_lost_grace_seconds=settings.node_lost_grace_s),
        features_image=settings.features_image,
        defaults=endpoint_defaults.EndpointDefaults.from_settings(settings),
    )
    # Deadlines, grace periods, TTLs and progress need a clock, not an event: jobs that are not idle are
    # reconciled every poll interval.
    runner = Runner(
        "TrainingJob", controller.reconcile, interval_s=settings.training_poll_s, timeout_s=settings.reconcile_timeout_s
    )

    # The pod and node indexes, bound once at start-up, for passes started by any trigger.
    controller.indexes.register()

    # Explicit ids: Kopf passes each index to handlers as a kwarg named by it (nested functions' default
    # ids would carry "register.<locals>.").
    @kopf.index("pods", labels={render.JOB_LABEL: kopf.PRESENT}, id=POD_INDEX)
    async def loom_training_pods(
        body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], tuple[WorkerView, str | None]] | None:
        view = observe_pod(dict(body))
        if view is None:
            return None
        key = (str(body.metadata.namespace), body.metadata.labels[render.JOB_LABEL])
        return {key: (view, body.status.get("podIP"))}

    # A node going NotReady (or coming back) moves its workers' jobs with the clock (the node-lost grace period):
    # their passes at once, since a steady job has no periodic one to notice it. Noticed here, in the index, not in
    # an event handler: a replica standing by must run no handler at all (e2e test_operator_ha), and Kopf's peering
    # does not pause a namespaced operator's watch of the cluster-scoped nodes; the leader alone triggers. The index
    # still holds the node's view from before this event (Kopf replaces it when the handler returns).
    @kopf.index("nodes", id=NODE_INDEX)
    async def loom_training_nodes(body: kopf.Body, **_: Any) -> dict[str, NodeView]:
        name, view = str(body.metadata.name), observe_node(dict(body))
        nodes: NodeIndex | None = controller.indexes.get(NODE_INDEX)
        before = next(iter(nodes.get(name, ())), None) if nodes is not None else None
        # A node seen for the first time (the operator starting) changed nothing: its jobs' first passes read it.
        if before is not None and before.ready != view.ready and await LEADERSHIP.leads():
            pods: PodIndex | None = controller.indexes.get(POD_INDEX)
            for job in jobs_with_workers_on(pods, name):
                runner.later(*job, 0)  # after this handler returned: the pass reads the node's new view
        return {name: view}

    # A worker's events come in bursts (created, bound to a node, started, ready: the gang's pods at once), and
    # each is a reason for a pass: one pass, WORKER_EVENTS_S after the first of them, reads them all.
    @kopf.on.event("pods", labels={render.JOB_LABEL: kopf.PRESENT})
    async def trainingjob_worker_event(body: kopf.Body, **kwargs: Any) -> None:
        runner.resync(kwargs.get(JOB_INDEX))
        runner.later(str(body.metadata.namespace), body.metadata.labels[render.JOB_LABEL], WORKER_EVENTS_S)

    # A queued job's Workload: Kueue admitting or evicting it is a reason to reconcile the job at once. Without
    # Kueue's CRDs Kopf only warns that the resource is not served, and watches once it is.
    @kopf.on.event(kueue.GROUP, "v1beta2", "workloads", labels={kueue.JOB_UID_LABEL: kopf.PRESENT})
    async def trainingjob_workload_event(body: kopf.Body, **_: Any) -> None:
        for owner in body.metadata.get("ownerReferences") or []:
            if owner.get("kind") == "TrainingJob" and owner.get("controller"):
                await runner.trigger(str(body.metadata.namespace), owner["name"])

    # Rank 0's progress, polled beside the passes: an answer the state machine acts on triggers the job's pass, and
    # for a steady job (pacing.py), which the periodic resync leaves alone, any change of the answer does.
    controller.progress = progress = ProgressPoller(on_news=runner.trigger, interval_s=settings.training_poll_s)
    controller.quiet = runner.quiet

    async def deleted(namespace: str, name: str, _spec: Mapping[str, Any]) -> None:
        progress.forget((namespace, name))
        controller.created.forget((namespace, name))

    # Every TrainingJob, flagged due while the periodic resync has something to do for it.
    own_kind_handlers(runner, PLURAL, JOB_INDEX, due=resync_due, deleted=deleted)


def jobs_with_workers_on(pods: PodIndex | None, node: str) -> list[tuple[str, str]]:
    """The jobs (namespace, name) with a worker on this node, from the pod index."""
    if pods is None:
        return []
    return [key for key, views in list(pods.items()) if any(view.node_name == node for view, _ in views)]


def children_due(decision: Decision, *, spec_changed: bool) -> bool:
    """Whether the pass applies the job's Service and ConfigMap: before it creates workers, and after a spec change
    of a job that still runs (the ConfigMap renders the spec)."""
    phase = decision.status.phase
    return bool(decision.create) or (spec_changed and phase not in FINISHED and not decision.delete_children)


def resync_due(body: kopf.Body) -> bool:
    """Whether the periodic resync has something to do for a job: False once it finished and, with a TTL, its
    children are deleted, and a succeeded job that registers its model has registered it (MLflow may have been
    down when it succeeded)."""
    status, spec = body.get("status") or {}, body.get("spec") or {}
    registered = (status.get("registeredModel") or {}).get("version")
    if spec.get("register") and status.get("phase") == "Succeeded" and not registered:
        return True
    ttl = (spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    return not (status.get("phase") in FINISHED and (ttl is None or bool(status.get("childrenDeleted"))))
