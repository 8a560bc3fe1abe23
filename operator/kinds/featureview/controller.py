"""FeatureView controller: its Reconciler on the skeleton (core/reconcile.py) and thin Kopf handlers.

A pass for one view reads the view and every FeatureView of its project, plans the project's FeaturesConfig
(pure), server-side applies the project's ConfigMap, Service and feature server Deployment, creates the Jobs that
are missing (apply for the current content, delete for views that vanished, materialize-now for a new annotation
token) and the CronJob, then computes status (pure) from the Jobs' termination messages and the Deployment.

Jobs are only ever created, never re-applied (their templates are immutable), and their names are derived from
what they do (content hash, token, view name), so a pass repeated after a crash creates nothing twice. One writer
of a project's registry at a time: no apply, delete or manual materialization Job starts while another Job of the
project runs (the file registry is rewritten whole, without locking); the scheduled CronJob is Forbid-concurrent.
No finalizer: see render.py for how deletion converges while the operator is down.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import kopf
from pydantic import ValidationError

from ...core import client as kube
from ...core import kit
from ...core.kit import Event, Manifest
from ...core.model import API_VERSION, InvalidSpec
from ...core.pod_problems import find_problem
from ...core.reconcile import Pass, StatusAfterApply, run
from ...core.runner import Runner, own_kind_handlers
from ...defaults import Defaulted, EndpointDefaults
from ...defaults import feature_view as feature_view_defaults
from ...settings import OperatorSettings
from .api import FEATURE_VIEW, FeatureViewSpec, FeatureViewStatus
from .config import (
    Member,
    ProjectPlan,
    Rejection,
    apply_hash,
    apply_job_name,
    cronjob_name,
    delete_job_name,
    embedding_url,
    feast_view_name,
    feature_refs,
    plan_project,
    project_object_name,
    project_prefix,
    server_url,
)
from .render import (
    COMMAND_LABEL,
    KIND,
    KIND_LABEL,
    MATERIALIZE_NOW,
    PERMANENT_EXIT_CODES,
    PROJECT_LABEL,
    VIEW_LABEL,
    registered_views,
    render_apply_job,
    render_config_map,
    render_cronjob,
    render_delete_job,
    render_deployment,
    render_manual_job,
    render_service,
    server_selector,
)
from .status import JobResult, compute_status, job_result, newest
from .status import Observed as StatusObserved
from .vector.io import model_sources, register_embedder_trigger

log = logging.getLogger("loom.operator.featureview")

PLURAL = "featureviews"
INDEX_ID = "loom_featureviews"
# A Job that failed for a reason worth retrying (exit 1: a store briefly unreachable) is re-created after this.
RETRY_FAILED_AFTER = timedelta(minutes=5)


def _spec(body: Manifest, defaults: EndpointDefaults) -> FeatureViewSpec | None:
    """The view's spec with the operator's S3 defaults filled in (defaults.py); None when unreadable."""
    try:
        return feature_view_defaults(FeatureViewSpec.model_validate(body.get("spec") or {}), defaults).spec
    except ValidationError:
        return None


def _finished(job: Manifest) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


def _pods_of(job: Manifest, pods: list[Manifest]) -> list[Manifest]:
    name = job["metadata"]["name"]
    return [p for p in pods if (p["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name") == name]


class _Project:
    """What a pass knows about the project's Jobs; creating a writer marks the registry busy for this pass."""

    def __init__(self, jobs: list[Manifest], pods: list[Manifest]) -> None:
        self.jobs = {j["metadata"]["name"]: j for j in jobs}
        self.pods = pods
        self.busy = any(not _finished(j) for j in jobs)

    def result(self, name: str) -> JobResult | None:
        job = self.jobs.get(name)
        return None if job is None else job_result(job, _pods_of(job, self.pods))

    async def create_writer(self, manifest: Manifest) -> bool:
        """Create the Job unless it exists or another writer runs; True when it exists afterwards."""
        name = manifest["metadata"]["name"]
        if name in self.jobs:
            return True
        if self.busy:
            return False
        self.jobs[name] = await kube.apply(manifest)
        self.busy = True
        return True

    async def retry_if_transient(self, name: str, now: datetime) -> None:
        """Drop a Job that failed for a retryable reason a while ago, so the next pass runs it again."""
        result = self.result(name)
        if result is None or result.state != "Failed" or result.exit_code in PERMANENT_EXIT_CODES:
            return
        finished = datetime.fromisoformat((result.completed or "").replace("Z", "+00:00")) if result.completed else None
        if finished is None or now - finished >= RETRY_FAILED_AFTER:
            await kube.delete("batch/v1", "Job", self.jobs[name]["metadata"]["namespace"], name)
            self.jobs.pop(name, None)


async def _members(namespace: str, project: str, defaults: EndpointDefaults) -> tuple[list[Member], set[str]]:
    """The project's views that are not being deleted, and the names of all of them."""
    members: list[Member] = []
    names: set[str] = set()
    for obj in await kube.list_objects(API_VERSION, KIND, namespace):
        spec = _spec(obj, defaults)
        meta = obj["metadata"]
        if spec is None or spec.project != project:
            continue
        if meta.get("deletionTimestamp"):
            continue
        names.add(meta["name"])
        members.append(Member(meta["name"], meta["uid"], meta.get("creationTimestamp") or "", spec, meta["namespace"]))
    return members, names


async def _sweep_deleted(
    namespace: str, plan: ProjectPlan, state: _Project, config_map: Manifest | None, alive: set[str], image: str
) -> list[str]:
    """Delete Jobs for views the registry may hold but that no longer exist; the names still pending."""
    pending: list[str] = []
    for view in registered_views(config_map):
        if view in alive:
            continue
        name = delete_job_name(plan.project, view)
        result = state.result(name)
        if result is not None and result.state == "Succeeded":
            continue
        if result is not None and result.state == "Failed":
            log.warning("removing FeatureView %s/%s from the registry failed: %s", namespace, view, result.message)
            if result.exit_code in PERMANENT_EXIT_CODES:
                continue
        await state.create_writer(render_delete_job(namespace, plan, view, image))
        pending.append(view)
    return pending


@dataclass
class Observed:
    """What a view's pass reads (its project's views, Jobs, pods, ConfigMap and server) and what it wrote."""

    now: datetime
    alive: set[str] = field(default_factory=set)
    members: list[Member] = field(default_factory=list)
    state: _Project | None = None
    config_map: Manifest | None = None
    live: Manifest | None = None  # the project's server Deployment
    apply_result: JobResult | None = None
    model_sources: dict[str, str] = field(default_factory=dict)  # embedding service -> its spec.model


class ViewReconciler(StatusAfterApply):
    kind: ClassVar[str] = KIND
    status_model: ClassVar[type[Any]] = FeatureViewStatus

    def __init__(self, settings: OperatorSettings) -> None:
        self.image = settings.features_image
        self.defaults = EndpointDefaults.from_settings(settings)

    def parse(self, body: Manifest) -> Defaulted[FeatureViewSpec]:
        return feature_view_defaults(FeatureViewSpec.model_validate(body.get("spec") or {}), self.defaults)

    def check(self, body: Manifest, spec: Defaulted[FeatureViewSpec]) -> None:
        name_problem = FEATURE_VIEW.name_rule.problem(body["metadata"]["name"])
        if name_problem is not None:  # the CRD refuses it since it has the rule
            raise InvalidSpec(name_problem)

    async def observe(self, ctx: Pass[Defaulted[FeatureViewSpec]]) -> Observed:
        observed = Observed(now=datetime.now(UTC))
        if ctx.spec is None or not ctx.valid:
            return observed
        spec = ctx.spec.spec
        observed.members, observed.alive = await _members(ctx.namespace, spec.project, self.defaults)
        selector = kit.selector({PROJECT_LABEL: project_prefix(spec.project)})
        jobs = await kube.list_objects("batch/v1", "Job", ctx.namespace, selector)
        pods = await kube.list_objects("v1", "Pod", ctx.namespace, selector)
        observed.state = _Project(jobs, pods)
        object_name = project_object_name(spec.project)
        observed.config_map = await kube.get("v1", "ConfigMap", ctx.namespace, object_name)
        # The live replicas: the autoscaler's to keep while the project's server is autoscaled.
        observed.live = await kube.get("apps/v1", "Deployment", ctx.namespace, object_name)
        observed.model_sources = await model_sources(ctx.namespace, observed.members)
        return observed

    def decide(self, ctx: Pass[Defaulted[FeatureViewSpec]], observed: Observed) -> ProjectPlan | None:
        if ctx.spec is None or not ctx.valid:
            return None
        return plan_project(ctx.spec.spec.project, observed.members, observed.model_sources)

    async def apply(
        self, ctx: Pass[Defaulted[FeatureViewSpec]], observed: Observed, plan: ProjectPlan | None
    ) -> Observed:
        assert ctx.spec is not None and plan is not None and observed.state is not None
        namespace, name, spec, state, image = ctx.namespace, ctx.name, ctx.spec.spec, observed.state, self.image
        # Project children. Deletions first: the ConfigMap below forgets the names they are for.
        pending = await _sweep_deleted(namespace, plan, state, observed.config_map, observed.alive, image)
        if plan.members:
            await kube.apply(render_config_map(namespace, plan, [m.name for m in plan.members] + pending))
            await kube.apply(render_service(namespace, plan))
            live_replicas = ((observed.live or {}).get("spec") or {}).get("replicas")
            live = None if observed.live is None else int(live_replicas or 0)
            await kube.apply(render_deployment(namespace, plan, image, live))
        # The view's own children.
        if plan.rejected.get(name) is None:
            job_name = apply_job_name(name, apply_hash(plan, name))
            await state.retry_if_transient(job_name, observed.now)
            await state.create_writer(render_apply_job(namespace, plan, name, image))
            observed.apply_result = state.result(job_name)
            succeeded = observed.apply_result is not None and observed.apply_result.state == "Succeeded"
            if succeeded:
                await _drop_old_applies(namespace, name, job_name, state)
            if spec.online:
                await kube.apply(render_cronjob(namespace, plan, name, image))
                token = (ctx.body["metadata"].get("annotations") or {}).get(MATERIALIZE_NOW)
                if token and succeeded:
                    await state.create_writer(render_manual_job(namespace, plan, name, token, image))
                await _drop_old_manual_runs(namespace, name, token, state)
            else:
                await kube.delete("batch/v1", "CronJob", namespace, cronjob_name(name))
        observed.live = await kube.get("apps/v1", "Deployment", namespace, project_object_name(spec.project))
        return observed

    def status(
        self,
        ctx: Pass[Defaulted[FeatureViewSpec]],
        observed: Observed,
        plan: ProjectPlan | None,
        previous: FeatureViewStatus | None,
    ) -> tuple[FeatureViewStatus, Sequence[Event]]:
        if ctx.spec is None or not ctx.valid or plan is None or observed.state is None:
            rejected = StatusObserved(ctx.generation, rejection=Rejection("InvalidSpec", ctx.invalid or ""))
            return compute_status(rejected, previous, observed.now)
        spec, state, name, apply_result = ctx.spec.spec, observed.state, ctx.name, observed.apply_result
        materializations = [
            r
            for job_name_, job in state.jobs.items()
            if (job["metadata"].get("labels") or {}).get(VIEW_LABEL) == name
            and (job["metadata"].get("labels") or {}).get(COMMAND_LABEL) == "materialize"
            and (r := state.result(job_name_)) is not None
        ]
        deployment = observed.live
        dstatus = (deployment or {}).get("status") or {}
        # Pods that cannot start (a missing Secret, ...): the apply Job's and the feature server's, from the pods
        # observe read with the project's Jobs.
        rejection = plan.rejected.get(name)
        apply_job = state.jobs.get(apply_job_name(name, apply_hash(plan, name))) if rejection is None else None
        apply_problem = find_problem(_pods_of(apply_job, state.pods)) if apply_job is not None else None
        serving = server_selector(spec.project).items()
        server_pods = [p for p in state.pods if serving <= (p["metadata"].get("labels") or {}).items()]
        seen = StatusObserved(
            ctx.generation,
            project=plan.config.project,
            feast_view=feast_view_name(name),
            feature_refs=tuple(feature_refs(name, [feature.name for feature in spec.features])),
            registry=plan.config.registry.location,
            online_store=plan.config.online_store.type,
            url=server_url(ctx.namespace, spec.project),
            online=spec.online,
            schedule=spec.materialization.schedule,
            suspended=spec.materialization.suspend,
            rejection=rejection,
            apply=apply_result,
            waiting_for_writer=apply_result is None and state.busy,
            materialization=newest(materializations),
            server_replicas=int(((deployment or {}).get("spec") or {}).get("replicas") or 0),
            server_ready=int(dstatus.get("readyReplicas") or 0),
            apply_problem=apply_problem,
            server_problem=find_problem(server_pods),
            vector=spec.vector,
            embedding_url=embedding_url(ctx.namespace, spec.vector.embedding.service)
            if spec.vector is not None and spec.vector.embedding is not None
            else None,
        )
        status, events = compute_status(seen, previous, observed.now)
        status.endpoint_defaults = ctx.spec.status_field()
        return status, events


async def reconcile(namespace: str, name: str, settings: OperatorSettings) -> None:
    """One full pass for one FeatureView (the skeleton: core/reconcile.py)."""
    await run(ViewReconciler(settings), namespace, name)


async def _drop_old_applies(namespace: str, name: str, current: str, state: _Project) -> None:
    """Apply Jobs of earlier content, once the current one has succeeded (the current one is the record)."""
    for job_name, job in list(state.jobs.items()):
        job_labels = job["metadata"].get("labels") or {}
        mine = job_labels.get(VIEW_LABEL) == name and job_labels.get(COMMAND_LABEL) == "apply"
        if mine and job_name != current and _finished(job):
            await kube.delete("batch/v1", "Job", namespace, job_name)
            state.jobs.pop(job_name, None)


async def _drop_old_manual_runs(namespace: str, name: str, token: str | None, state: _Project) -> None:
    """Finished Jobs of earlier materialize-now tokens, once a later run of the view has finished (that one is
    the status record now). The current token's Job always stays: it must not run twice."""
    runs = [
        job
        for job in state.jobs.values()
        if (job["metadata"].get("labels") or {}).get(VIEW_LABEL) == name
        and (job["metadata"].get("labels") or {}).get(COMMAND_LABEL) == "materialize"
    ]
    finished = sorted((j["metadata"].get("creationTimestamp") or "" for j in runs if _finished(j)), reverse=True)
    if not finished:
        return
    for job in runs:
        meta = job["metadata"]
        earlier = (meta.get("annotations") or {}).get(MATERIALIZE_NOW)
        if earlier is None or earlier == token or not _finished(job):
            continue
        if (meta.get("creationTimestamp") or "") < finished[0]:
            await kube.delete("batch/v1", "Job", namespace, meta["name"])
            state.jobs.pop(meta["name"], None)


def register(settings: OperatorSettings) -> None:
    async def one_pass(namespace: str, name: str) -> None:
        await reconcile(namespace, name, settings)

    runner = Runner(KIND, one_pass, interval_s=settings.resync_interval_s, timeout_s=settings.reconcile_timeout_s)

    async def trigger_project(namespace: str, project: str) -> None:
        for obj in await kube.list_objects(API_VERSION, KIND, namespace):
            if project_prefix(str((obj.get("spec") or {}).get("project") or "")) == project:
                await runner.trigger(namespace, obj["metadata"]["name"])

    async def project_of_deleted(namespace: str, name: str, spec: Mapping[str, Any]) -> None:
        # The project's other views sweep the deleted view out of the registry.
        await trigger_project(namespace, project_prefix(str(spec.get("project") or "")))

    # A materialize-now token runs the view's materialization at once. No finalizer: children go with the object
    # (ownerReferences).
    own_kind_handlers(
        runner, PLURAL, INDEX_ID, also_on=[("metadata", "annotations", MATERIALIZE_NOW)], deleted=project_of_deleted
    )

    register_embedder_trigger(runner)

    # Jobs finishing and the server becoming ready move status: react instead of polling.
    @kopf.on.event("batch", "v1", "jobs", labels={"app.kubernetes.io/name": KIND_LABEL})
    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/name": KIND_LABEL})
    async def _child_changed(body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata", {})
        child_labels = meta.get("labels") or {}
        namespace = meta.get("namespace")
        if not namespace:
            return
        view = child_labels.get(VIEW_LABEL)
        if view:
            await runner.trigger(namespace, view)
        elif child_labels.get(PROJECT_LABEL):
            await trigger_project(namespace, child_labels[PROJECT_LABEL])
