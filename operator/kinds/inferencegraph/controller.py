"""InferenceGraph controller: its Reconciler on the skeleton (core/reconcile.py) and thin Kopf handlers.

A pass: observe the InferenceServices its steps name and its router Deployment -> decide the RouterConfig (pure;
problems become a condition, never a crash loop) -> server-side apply ConfigMap, Deployment, Service -> status
(pure), written with the events by the skeleton. Every entry point goes through the shared runner
(core/runner.py): create/resume/spec update, the periodic resync, a change of the router Deployment, and a change
of a referenced InferenceService (found through an index from (namespace, service) to the graphs naming it), so
readiness and model names follow the services without polling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import kopf

from loom.workloads.router.config import RouterConfig

from ...core import client as kube
from ...core.kit import Event, Manifest
from ...core.model import API_VERSION, GROUP, VERSION
from ...core.pod_problems import find_problem
from ...core.pods import PodIndex, pods_of
from ...core.reconcile import Pass, StatusAfterApply, run
from ...core.runner import Indexes, LastSeen, Runner, child_handlers, own_kind_handlers, register_pod_index
from ...settings import OperatorSettings
from .api import InferenceGraphSpec, InferenceGraphStatus
from .render import (
    KIND_LABEL,
    GraphProblem,
    ServiceRef,
    deployment_name,
    observe_service,
    referenced_services,
    render_router,
    router_config,
    router_selector,
    service_conflict,
    service_name,
)
from .retrieval import ViewRef, embedding_services, observe_view, referenced_views
from .status import Observed as StatusObserved
from .status import compute_status

log = logging.getLogger("loom.operator.inferencegraph")

PLURAL = "inferencegraphs"
KIND = "InferenceGraph"
INDEX_ID = "loom_inferencegraphs"
BY_SERVICE_INDEX_ID = "loom_inferencegraphs_by_service"
BY_VIEW_INDEX_ID = "loom_inferencegraphs_by_featureview"
POD_INDEX_ID = "loom_inferencegraph_pods"


@dataclass
class Observed:
    """What a graph's pass reads: the InferenceServices its steps name, its Service, its router Deployment."""

    services: dict[str, ServiceRef] = field(default_factory=dict)
    views: dict[str, ViewRef] = field(default_factory=dict)  # the retrieve steps' FeatureViews that exist
    existing_service: Manifest | None = None
    deployment: Manifest | None = None
    pods: list[Manifest] = field(default_factory=list)  # the router's, from the watch cache


@dataclass(frozen=True)
class Plan:
    config: RouterConfig | None
    problem: GraphProblem | None


class GraphReconciler(StatusAfterApply):
    kind: ClassVar[str] = KIND
    status_model: ClassVar[type[Any]] = InferenceGraphStatus

    def __init__(self, settings: OperatorSettings, pods: PodIndex | None = None) -> None:
        self.settings = settings
        self.pods = pods

    def parse(self, body: Manifest) -> InferenceGraphSpec:
        return InferenceGraphSpec.model_validate(body.get("spec") or {})

    def check(self, body: Manifest, spec: InferenceGraphSpec) -> None:
        """Nothing beyond the schema: what else a graph can get wrong is reported by `router_config`."""

    async def observe(self, ctx: Pass[InferenceGraphSpec]) -> Observed:
        observed = Observed()
        if ctx.spec is not None:
            wanted = set(referenced_services(ctx.spec)) | set(embedding_services(ctx.spec))
            for view_name in referenced_views(ctx.spec):
                view = await kube.get(API_VERSION, "FeatureView", ctx.namespace, view_name)
                if view is not None and not view["metadata"].get("deletionTimestamp"):
                    observed.views[view_name] = observe_view(view)
            if wanted:
                # Each by name: served by the watch cache (core/watch_cache.py), no LIST per pass.
                for wanted_name in sorted(wanted):
                    isvc = await kube.get(API_VERSION, "InferenceService", ctx.namespace, wanted_name)
                    if isvc is not None and not isvc["metadata"].get("deletionTimestamp"):
                        ref = observe_service(isvc)
                        observed.services[ref.name] = ref
        observed.deployment = await kube.get("apps/v1", "Deployment", ctx.namespace, deployment_name(ctx.name))
        # A router pod that cannot start (a missing Secret, the image, ...) is named in RouterAvailable and Ready.
        observed.pods = pods_of(self.pods, ctx.namespace, ctx.name, router_selector(ctx.owner))
        return observed

    def decide(self, ctx: Pass[InferenceGraphSpec], observed: Observed) -> Plan:
        if ctx.spec is None:
            return Plan(None, GraphProblem("InvalidGraph", ctx.invalid or ""))
        config, problem = router_config(ctx.owner, ctx.spec, observed.services, observed.views)
        return Plan(config, problem)

    async def apply(self, ctx: Pass[InferenceGraphSpec], observed: Observed, plan: Plan) -> Observed:
        assert ctx.spec is not None
        if plan.config is None:
            return observed
        observed.existing_service = await kube.get("v1", "Service", ctx.namespace, service_name(ctx.name))
        conflict = service_conflict(ctx.owner, observed.existing_service)
        for manifest in render_router(ctx.owner, ctx.spec, plan.config, self.settings.router_image):
            if manifest["kind"] == "Service" and conflict is not None:
                continue  # another object's Service: reported, never taken over
            applied = await kube.apply(manifest)
            if manifest["kind"] == "Deployment":
                observed.deployment = applied
        return observed

    def status(
        self,
        ctx: Pass[InferenceGraphSpec],
        observed: Observed,
        plan: Plan,
        previous: InferenceGraphStatus | None,
    ) -> tuple[InferenceGraphStatus, Sequence[Event]]:
        problem = plan.problem
        if plan.config is not None and ctx.spec is not None:
            problem = service_conflict(ctx.owner, observed.existing_service)
        pod_problem = find_problem(observed.pods) if observed.deployment is not None else None
        seen = StatusObserved(observed.deployment, observed.services, problem, pod_problem)
        return compute_status(ctx.owner, ctx.spec, seen, previous)


async def reconcile(namespace: str, name: str, settings: OperatorSettings, pods: PodIndex | None = None) -> None:
    """One full pass for one InferenceGraph, read fresh (the skeleton: core/reconcile.py); `pods`: the router
    pods' watch cache (none: no pod is looked at)."""
    await run(GraphReconciler(settings, pods), namespace, name)


def _raw_steps(spec: Manifest | None) -> list[Manifest]:
    """Every step of a raw spec that is an object (the indexes must not fail on a spec that does not validate)."""
    nodes = (spec or {}).get("nodes")
    return [
        step
        for node in (nodes.values() if isinstance(nodes, dict) else [])
        for step in ((node or {}).get("steps") or [] if isinstance(node, dict) else [])
        if isinstance(step, dict)
    ]


def services_named(spec: Manifest | None) -> set[str]:
    """serviceName of every step of a raw spec, and every retrieve step's embeddingService."""
    names: set[str] = set()
    for step in _raw_steps(spec):
        if step.get("serviceName"):
            names.add(str(step["serviceName"]))
        retrieve = step.get("retrieve")
        if isinstance(retrieve, dict) and retrieve.get("embeddingService"):
            names.add(str(retrieve["embeddingService"]))
    return names


def views_named(spec: Manifest | None) -> set[str]:
    """featureView of every retrieve step of a raw spec."""
    names: set[str] = set()
    for step in _raw_steps(spec):
        retrieve = step.get("retrieve")
        if isinstance(retrieve, dict) and retrieve.get("featureView"):
            names.add(str(retrieve["featureView"]))
    return names


def _service_state(body: Manifest) -> tuple[Any, ...]:
    """What of an InferenceService a graph depends on: its Ready condition and the model name it serves."""
    ref = observe_service(body)
    return (ref.ready, ref.reason, ref.model_name)


def register(settings: OperatorSettings) -> None:
    indexes = Indexes(POD_INDEX_ID)

    async def one_pass(namespace: str, name: str) -> None:
        await reconcile(namespace, name, settings, indexes.get(POD_INDEX_ID))

    runner = Runner(KIND, one_pass, interval_s=settings.resync_interval_s, timeout_s=settings.reconcile_timeout_s)
    # Last (ready, reason, model name) seen per InferenceService: its status changes often, only these matter.
    seen: LastSeen[tuple[Any, ...]] = LastSeen()

    # Spec changes, deletion and the periodic resync; children go with the object (ownerReferences): no finalizer.
    own_kind_handlers(runner, PLURAL, INDEX_ID)

    # The router's pods, for why one cannot start: a watch cache bound once at start-up, never a LIST per pass.
    register_pod_index(KIND_LABEL, POD_INDEX_ID)
    indexes.register()

    # (namespace, InferenceService) -> names of the graphs whose steps name it.
    @kopf.index(GROUP, VERSION, PLURAL, id=BY_SERVICE_INDEX_ID)
    async def _by_service(namespace: str | None, name: str | None, spec: Any, **_: Any) -> dict[tuple[str, str], str]:
        return {(str(namespace), service): str(name) for service in services_named(dict(spec or {}))}

    # (namespace, FeatureView) -> names of the graphs whose retrieve steps name it.
    @kopf.index(GROUP, VERSION, PLURAL, id=BY_VIEW_INDEX_ID)
    async def _by_view(namespace: str | None, name: str | None, spec: Any, **_: Any) -> dict[tuple[str, str], str]:
        return {(str(namespace), view): str(name) for view in views_named(dict(spec or {}))}

    # What of a FeatureView a graph uses: its status.vectorSearch (where to search, which model embeds).
    views_seen: LastSeen[tuple[Any, ...]] = LastSeen()

    @kopf.on.event(GROUP, VERSION, "featureviews")
    async def _view_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        meta = body.get("metadata", {})
        namespace, view = meta.get("namespace"), meta.get("name")
        if not namespace or not view:
            return
        key = (str(namespace), str(view))
        state = (repr(sorted((observe_view(dict(body)).vector_search or {}).items())),)
        if type == "DELETED":
            views_seen.forget(key)
        elif not views_seen.changed(key, state):
            return
        index = kwargs.get(BY_VIEW_INDEX_ID) or {}
        for graph in sorted(set(index.get(key, ()))):
            await runner.trigger(key[0], graph)

    # The router's rollout and readiness come with its Deployment's status.
    child_handlers(runner, KIND_LABEL, ("apps", "v1", "deployments"))

    # A referenced InferenceService appeared, went (un)ready, changed its model name or was deleted.
    @kopf.on.event(GROUP, VERSION, "inferenceservices")
    async def _service_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        meta = body.get("metadata", {})
        namespace, service = meta.get("namespace"), meta.get("name")
        if not namespace or not service:
            return
        key = (str(namespace), str(service))
        if type == "DELETED":
            seen.forget(key)
        elif not seen.changed(key, _service_state(dict(body))):
            return
        index = kwargs.get(BY_SERVICE_INDEX_ID) or {}
        for graph in sorted(set(index.get(key, ()))):
            await runner.trigger(key[0], graph)
