"""InferenceService controller: its Reconciler on the skeleton (core/reconcile.py) and thin Kopf handlers.

Every entry point (create/resume/spec update, the periodic resync, a change of one of our Deployments, a new
checkpoint of a referenced TrainingJob) triggers the same pass through the shared runner (core/runner.py), which
serialises, coalesces and bounds passes per object. A pass: parse -> observe (its Deployments, the model and features
resolved, its pods) -> plan (pure) -> render (pure) and server-side apply -> status (pure), written with the events by
the skeleton. Everything the pass needs is in the
cluster (the stable model is an annotation on the stable Deployment), so the operator can be killed at any
instant: the next pass converges, creating nothing twice (deterministic names, server-side apply).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

import kopf
from pydantic import ValidationError

from loom.workloads.llm.adapters import AdapterList
from loom.workloads.server.config import EnrichmentConfig

from ...core import client as kube
from ...core import kueue
from ...core.kit import Event, Manifest
from ...core.model import API_VERSION, GROUP, VERSION, first_error
from ...core.pod_problems import find_problem
from ...core.pods import PodIndex, pods_of
from ...core.reconcile import Pass, StatusAfterApply, run
from ...core.runner import Indexes, LastSeen, Runner, child_handlers, own_kind_handlers, register_pod_index
from ...defaults import Defaulted, EndpointDefaults, model_problem, training_job_manifest
from ...defaults import inference_service as inference_service_defaults
from ...settings import OperatorSettings
from .api import INFERENCE_SERVICE, AliasStatus, InferenceServiceSpec, InferenceServiceStatus
from .autoscaling.replicas import recommend_replicas
from .canary.analysis import seconds_until_due
from .canary.judge import WEIGHT_ANNOTATION, AnalysisInput, Judgement, held_percent, judge_canary, persist_rollout
from .canary.judge import read_analysis as read_canary_analysis
from .canary.report import analysis_condition
from .enrichment.resolve import resolve_features
from .llm import adapters as lora
from .llm.adapters import ResolvedAdapters
from .llm.io import observe_adapters, read_reports
from .queue.admission import Admission, ServiceQueue, admit, report_status
from .queue.io import act_on_queue, observe_queue
from .render import (
    CONFIG_HASH_ANNOTATION,
    KIND_LABEL,
    InvalidSpec,
    Track,
    config_map_name,
    deployment_name,
    render_deployment,
    rollout_strategy,
    selector_string,
    server_config,
    server_selector,
)
from .rollout import RolloutPlan, desired_total_replicas, model_of, plan_rollout
from .source.alias import change_reason, followed, previous_alias, resolve_alias
from .source.follows import Followed, followers, index_entries
from .source.model import ModelRef, ResolveError, resolve_model
from .status import Observed as StatusObserved
from .status import compute_status
from .traffic.activator import activator_enabled, activator_selector
from .traffic.io import apply_routing

log = logging.getLogger("loom.operator.inferenceservice")
# While an adapter loads somewhere, the next look at the replicas' adapter states (status follows them).
ADAPTER_POLL_SECONDS = 2.0

PLURAL = "inferenceservices"
KIND = "InferenceService"
INDEX_ID = "loom_inferenceservices"
POD_INDEX_ID = "loom_inferenceservice_pods"
FOLLOWERS_INDEX_ID = "loom_inferenceservice_followers"  # (kind, namespace, name) -> the services following it


async def _resolve(
    spec: InferenceServiceSpec, namespace: str, defaults: EndpointDefaults, alias_version: str | None = None
) -> tuple[ModelRef | None, ResolveError | None]:
    job = None
    if spec.model.from_training_job is not None:
        job = await kube.get(API_VERSION, "TrainingJob", namespace, spec.model.from_training_job.name)
        # The job's checkpoints are where it wrote them: with the operator's S3 defaults where it names none.
        job = training_job_manifest(job, defaults) if job is not None else None
    try:
        return resolve_model(spec.model, spec.serving_handler, job, spec.runtime, alias_version), None
    except ResolveError as err:
        return None, err


async def _features(spec: InferenceServiceSpec, namespace: str) -> tuple[EnrichmentConfig | None, ResolveError | None]:
    if spec.features is None:
        return None, None
    view = await kube.get(API_VERSION, "FeatureView", namespace, spec.features.feature_view)
    try:
        return resolve_features(spec.features, view, namespace), None
    except ResolveError as err:
        return None, err


async def _apply_track(
    owner: Manifest,
    spec: InferenceServiceSpec,
    track: Track,
    ref: ModelRef,
    replicas: int,
    image: str,
    vllm_image: str,
    features: EnrichmentConfig | None = None,
    weight: int | None = None,
    placement: list[kueue.FlavorView] | None = None,
    adapters: AdapterList | None = None,
) -> Manifest:
    config_map, deployment = render_deployment(
        owner, spec, track, ref, replicas, image, features, vllm_image, adapters
    )
    if placement:  # queued by Kueue: on the admitted flavor's nodes
        deployment["spec"]["template"] = kueue.place(deployment["spec"]["template"], placement)
    if weight is not None:  # the analysis' step this canary runs: its pause counts once this rolled out
        deployment["metadata"].setdefault("annotations", {})[WEIGHT_ANNOTATION] = str(weight)
    await kube.apply(config_map)  # before the Deployment: new pods must find their config
    return await kube.apply(deployment)


async def _retire_canary(namespace: str, name: str) -> None:
    # ConfigMap first: if the operator dies in between, the Deployment is still there to retire next pass.
    await kube.delete("v1", "ConfigMap", namespace, config_map_name(name, "canary"))
    await kube.delete("apps/v1", "Deployment", namespace, deployment_name(name, "canary"))


def _template_hash(deployment: Manifest | None) -> str | None:
    if deployment is None:
        return None
    annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
    return annotations.get(CONFIG_HASH_ANNOTATION)


@dataclass
class Observed:
    """What a service's pass reads: its two tracks, its model and features resolved, its pods."""

    stable: Manifest | None = None
    canary: Manifest | None = None
    pods: list[Manifest] = field(default_factory=list)
    activator_pods: list[Manifest] = field(default_factory=list)  # the scale-to-zero activator's (watch cache)
    desired: ModelRef | None = None
    resolve_error: ResolveError | None = None
    features: EnrichmentConfig | None = None
    features_error: ResolveError | None = None
    analysis: AnalysisInput | None = None  # what the canary analysis read, while a canary is judged
    alias: AliasStatus | None = None  # the followed MLflow alias, as last asked
    queue: ServiceQueue | None = None  # labelled kueue.x-k8s.io/queue-name: its Workloads (queueing.py)
    adapters: ResolvedAdapters | None = None  # spec.adapters resolved (None: the service has none)
    adapter_reports: dict[str, dict[str, Any] | str] = field(default_factory=dict)  # ready pod -> its report
    plan: RolloutPlan = field(default_factory=lambda: RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting"))


@dataclass(frozen=True)
class Plan:
    rollout: RolloutPlan
    invalid: str | None  # the pass's own, or the server contract's refusal of what the CRD allows
    judgement: Judgement | None = None  # the canary analysis' decision this pass
    admission: Admission | None = None  # queued by Kueue: the replicas admitted (caps the rollout's total)


class ServiceReconciler(StatusAfterApply):
    kind: ClassVar[str] = KIND
    status_model: ClassVar[type[Any]] = InferenceServiceStatus

    def __init__(
        self,
        settings: OperatorSettings,
        pods: PodIndex | None = None,
        later: Callable[[str, str, float], None] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.settings = settings
        self.pods = pods
        self.defaults = EndpointDefaults.from_settings(settings)
        self.later = later  # asks the runner for another pass in that many seconds (the analysis' next check)
        self.now = now

    def parse(self, body: Manifest) -> Defaulted[InferenceServiceSpec]:
        # The operator's endpoint defaults fill what the spec leaves unset (defaults.py).
        return inference_service_defaults(InferenceServiceSpec.model_validate(body.get("spec") or {}), self.defaults)

    def check(self, body: Manifest, spec: Defaulted[InferenceServiceSpec]) -> None:
        rollout_strategy(spec.spec)  # raises InvalidSpec for what admission cannot catch
        if (name_problem := INFERENCE_SERVICE.name_rule.problem(body["metadata"]["name"])) is not None:
            raise InvalidSpec(name_problem)  # the CRD refuses it now
        if (adapter_problem := lora.name_problem(body, spec.spec)) is not None:
            raise InvalidSpec(adapter_problem)

    async def observe(self, ctx: Pass[Defaulted[InferenceServiceSpec]]) -> Observed:
        namespace, name = ctx.namespace, ctx.name
        observed = Observed(
            stable=await kube.get("apps/v1", "Deployment", namespace, deployment_name(name, "stable")),
            canary=await kube.get("apps/v1", "Deployment", namespace, deployment_name(name, "canary")),
        )
        if ctx.spec is not None and ctx.valid:
            spec = ctx.spec.spec
            missing = model_problem(ctx.spec)
            if missing is not None:
                observed.resolve_error = missing  # nothing can be fetched without the endpoint
            else:
                observed.alias, alias_error = await resolve_alias(spec.model, previous_alias(ctx.body), self.now())
                if alias_error is not None:
                    observed.resolve_error = alias_error
                else:
                    version = observed.alias.version if observed.alias is not None else None
                    observed.desired, observed.resolve_error = await _resolve(spec, namespace, self.defaults, version)
            observed.features, observed.features_error = await _features(spec, namespace)
            observed.adapters = await observe_adapters(spec, namespace, self.defaults)
            if observed.features_error is not None:
                observed.desired = None
                observed.resolve_error = observed.resolve_error or observed.features_error
            analysis = spec.rollout.analysis
            stable_ref = model_of(observed.stable)
            if analysis is not None and observed.desired is not None and stable_ref is not None \
                    and observed.desired != stable_ref:
                observed.analysis = await read_canary_analysis(
                    analysis, ctx.body, desired=observed.desired, stable_ref=stable_ref, stable=observed.stable,
                    canary=observed.canary, runtime=spec.runtime, prometheus_url=self.settings.prometheus_url,
                    now=self.now(),
                )  # fmt: skip
        # The serving pods from the pod index (Kopf's watch cache; populated before any pass runs), a LIST only
        # when a pass runs without it.
        observed.pods = (
            pods_of(self.pods, namespace, name, server_selector(ctx.owner)) if self.pods is not None
            else await kube.list_objects("v1", "Pod", namespace, selector_string(ctx.owner))
        )
        observed.queue = await observe_queue(ctx.body) if ctx.spec is not None else None
        if observed.adapters is not None:
            observed.adapter_reports = await read_reports(observed.pods)
        # The scale-to-zero activator's pods (when it runs): one that cannot start is named in Ready at zero.
        if ctx.spec is not None and activator_enabled(ctx.spec.spec):
            observed.activator_pods = pods_of(self.pods, namespace, name, activator_selector(ctx.owner))
        return observed

    def decide(self, ctx: Pass[Defaulted[InferenceServiceSpec]], observed: Observed) -> Plan:
        if ctx.spec is None:
            return Plan(observed.plan, ctx.invalid)
        spec, stable, canary = ctx.spec.spec, observed.stable, observed.canary
        running = sum(int((d or {}).get("spec", {}).get("replicas", 0)) for d in (stable, canary))
        total = desired_total_replicas(spec, recommend_replicas(spec, running) if spec.autoscaling else None)
        admission = None
        if observed.queue is not None:  # what Kueue admitted caps it; the rest waits, reported (queueing.py)
            live = sum(max(int((d or {}).get("spec", {}).get("replicas", 0)), int((d or {}).get("status", {})
                           .get("replicas", 0))) for d in (stable, canary))  # fmt: skip
            admission = admit(observed.queue, spec, total, live)
            total = admission.replicas
        invalid = ctx.invalid
        if invalid is None and observed.desired is not None:
            try:
                server_config(ctx.owner, spec, observed.desired, observed.features)  # the server's own contract
            except (InvalidSpec, ValidationError) as exc:
                invalid = first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        held = held_percent(spec, ctx.body, canary)
        if invalid is not None or observed.features_error is not None:
            # Touch nothing; report what still runs. Without its FeatureView (not found, not Ready) a running
            # server keeps the features it was rendered with; none is rendered without them.
            return Plan(plan_rollout(spec, None, stable, canary, total, held), invalid, None, admission)
        if spec.rollout.analysis is not None and observed.analysis is not None:
            judged = judge_canary(spec.rollout.analysis, observed.analysis)
            rollout = plan_rollout(spec, judged.run, stable, canary, total, judged.percent, judged.rejecting)
            return Plan(rollout, None, judged, admission)
        return Plan(plan_rollout(spec, observed.desired, stable, canary, total, held), None, None, admission)

    async def apply(self, ctx: Pass[Defaulted[InferenceServiceSpec]], observed: Observed, plan: Plan) -> Observed:
        assert ctx.spec is not None
        observed.plan = plan.rollout
        judged = plan.judgement
        if judged is not None:
            # The verdict is written before anything acts on it: killed in between, the next pass reads it back
            # (a rolled-back version stays rejected, a step once started keeps its start).
            assert observed.analysis is not None
            target = followed(ctx.spec.spec.model)
            await persist_rollout(ctx, judged, observed.analysis, ctx.spec.spec.rollout.analysis,
                                  target[1] if target else None)  # fmt: skip
        weight = judged.outcome.state.weight if judged is not None and judged.outcome is not None else None
        placement = observed.queue.admitted_flavors() if observed.queue is not None else None
        if plan.invalid is None and observed.features_error is None and plan.rollout.stable_ref is not None:
            adapters = observed.adapters.to_list() if observed.adapters is not None else None
            observed.stable, observed.canary, observed.plan = await _apply(
                ctx.owner, ctx.spec.spec, plan.rollout, observed.stable, observed.canary, self.settings,
                observed.features, weight, placement, adapters,
            )  # fmt: skip
        if plan.admission is not None and observed.queue is not None:
            await act_on_queue(ctx, plan.admission, observed.queue, self._pod_template(ctx, observed, plan))
        analysis = ctx.spec.spec.rollout.analysis
        state = judged.status.analysis if judged is not None else None
        if analysis is not None and self.later is not None and (wait := seconds_until_due(analysis, state, self.now())):
            self.later(ctx.namespace, ctx.name, wait)
        if followed(ctx.spec.spec.model) is not None and self.later is not None:
            self.later(ctx.namespace, ctx.name, ctx.spec.spec.model.alias_poll_seconds)
        resolved = observed.adapters
        # Replicas load adapters by themselves; look again soon while any is on its way (status follows).
        if resolved is not None and self.later is not None \
                and not lora.settled(lora.adapter_status(resolved, observed.adapter_reports)):
            self.later(ctx.namespace, ctx.name, ADAPTER_POLL_SECONDS)
        return observed

    def _pod_template(
        self, ctx: Pass[Defaulted[InferenceServiceSpec]], observed: Observed, plan: Plan
    ) -> Manifest | None:
        """A replica's pod template, for what a Workload accounts (None: no model resolved, nothing to render)."""
        ref = plan.rollout.stable_ref or observed.desired
        if ctx.spec is None or ref is None or plan.invalid is not None:
            return None
        spec, settings = ctx.spec.spec, self.settings
        _, deployment = render_deployment(
            ctx.owner, spec, "stable", ref, 1, settings.server_image, observed.features, settings.vllm_image
        )
        template: Manifest = deployment["spec"]["template"]
        return template

    def status(
        self,
        ctx: Pass[Defaulted[InferenceServiceSpec]],
        observed: Observed,
        plan: Plan,
        previous: InferenceServiceStatus | None,
    ) -> tuple[InferenceServiceStatus, Sequence[Event]]:
        rollout = observed.plan if ctx.valid else plan.rollout
        serving_track: Track = "canary" if rollout.canary_action == "apply" else "stable"
        seen = StatusObserved(
            plan=rollout,
            stable=observed.stable,
            canary=observed.canary,
            pods=observed.pods,
            serving_config_hash=_template_hash(observed.canary if serving_track == "canary" else observed.stable),
            resolve_error=observed.resolve_error,
            invalid=plan.invalid,
            activator_problem=find_problem(observed.activator_pods),
            queued=(plan.admission.state, plan.admission.message) if plan.admission and not plan.admission.replicas
            else None,
            runtime=ctx.spec.spec.runtime if ctx.spec is not None else "default",
        )
        status, events = compute_status(ctx.owner, seen, previous)
        if plan.admission is not None and observed.queue is not None:
            events = [*events, *report_status(status, plan.admission, observed.queue, previous, ctx.generation)]
        status.endpoint_defaults = ctx.spec.status_field() if ctx.spec is not None else None
        if ctx.spec is not None and followed(ctx.spec.spec.model) is not None:
            status.alias = observed.alias or (previous.alias if previous else None)
        status.model_changed = change_reason(status.alias) or (previous.model_changed if previous else None)
        judged = plan.judgement
        status.rollout = judged.status if judged is not None else (previous.rollout if previous else None)
        if status.rollout is not None:
            # Announced by the analysis' own events (one per step, check failure, hold, verdict), not twice.
            status.conditions = analysis_condition(status.conditions, status.rollout, ctx.generation)
        if observed.adapters is not None:
            status.adapters = lora.adapter_status(observed.adapters, observed.adapter_reports)
        return status, events


async def reconcile(
    namespace: str,
    name: str,
    settings: OperatorSettings,
    pods: PodIndex | None = None,
    later: Callable[[str, str, float], None] | None = None,
) -> None:
    """One full pass for one InferenceService, read fresh (the runner serialises passes per object, so a pass
    sees the status the previous one wrote and announces each transition once; the skeleton: core/reconcile.py)."""
    await run(ServiceReconciler(settings, pods, later), namespace, name)


async def _apply(
    owner: Manifest,
    spec: InferenceServiceSpec,
    plan: RolloutPlan,
    stable: Manifest | None,
    canary: Manifest | None,
    settings: OperatorSettings,
    features: EnrichmentConfig | None = None,
    canary_weight: int | None = None,
    placement: list[kueue.FlavorView] | None = None,
    adapters: AdapterList | None = None,
) -> tuple[Manifest | None, Manifest | None, RolloutPlan]:
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    image = settings.server_image
    assert plan.stable_ref is not None
    # The Service, selecting the scale-to-zero activator while no replica is Ready (and the activator itself).
    await apply_routing(owner, spec, plan, stable, canary, settings)
    stable = await _apply_track(
        owner, spec, "stable", plan.stable_ref, plan.stable_replicas, image, settings.vllm_image, features,
        placement=placement, adapters=adapters,
    )  # fmt: skip
    if plan.canary_action == "apply":
        assert plan.canary_ref is not None
        canary = await _apply_track(
            owner, spec, "canary", plan.canary_ref, plan.canary_replicas, image, settings.vllm_image, features,
            canary_weight, placement, adapters,
        )
    elif plan.canary_action == "keep":
        # Judge the stable track as it is after this apply: a no-op apply may show it already rolled out.
        settled = plan_rollout(spec, plan.stable_ref, stable, canary, plan.stable_replicas)
        if settled.canary_action == "retire":
            plan = settled
    if plan.canary_action == "retire":
        await _retire_canary(namespace, name)
        canary = None
        plan = RolloutPlan(stable_ref=plan.stable_ref, stable_replicas=plan.stable_replicas)  # steady from now
    return stable, canary, plan


def register(settings: OperatorSettings) -> None:
    indexes = Indexes(POD_INDEX_ID)

    async def one_pass(namespace: str, name: str) -> None:
        await reconcile(namespace, name, settings, indexes.get(POD_INDEX_ID), runner.later)

    runner = Runner(KIND, one_pass, interval_s=settings.resync_interval_s, timeout_s=settings.reconcile_timeout_s)
    # Last (checkpoint, phase) seen per TrainingJob: a job's status changes often, only these matter here.
    checkpoints: LastSeen[tuple[Any, Any]] = LastSeen()

    # Spec changes, and the resync: the safety net that converges status and corrects drift even after a
    # missed watch event. Children go with the object (ownerReferences): no finalizer.
    own_kind_handlers(runner, PLURAL, INDEX_ID)

    # The activator's pods, for why one cannot start: a watch cache bound once at start-up, not a LIST per pass.
    register_pod_index(KIND_LABEL, POD_INDEX_ID)
    indexes.register()

    # Rollouts progress with the Deployments' status: react to it instead of polling.
    child_handlers(runner, KIND_LABEL, ("apps", "v1", "deployments"))

    # The TrainingJobs and FeatureViews each service follows (follows.py): looked up by the handlers below.
    @kopf.index(GROUP, VERSION, PLURAL, id=FOLLOWERS_INDEX_ID)
    async def _followers(namespace: str | None, name: str | None, spec: Any, **_: Any) -> dict[Any, str]:
        return index_entries(str(namespace), str(name), spec)

    # A queued service's Workloads: Kueue admitting or evicting one is a reason for a pass at once.
    @kopf.on.event(kueue.GROUP, "v1beta2", "workloads", labels={kueue.JOB_UID_LABEL: kopf.PRESENT})
    async def inferenceservice_workload_event(body: kopf.Body, **_: Any) -> None:
        for owner in body.metadata.get("ownerReferences") or []:
            if owner.get("kind") == KIND and owner.get("controller"):
                await runner.trigger(str(body.metadata.namespace), owner["name"])

    async def followed_changed(
        kind: Followed, memory: LastSeen[tuple[Any, Any]], body: kopf.Body, event: str | None, seen: tuple[Any, Any],
        index: Any,
    ) -> None:
        """Re-run the services following `body` (follows.py) when the fields `seen` of it changed, or it is gone."""
        meta = body.get("metadata", {})
        namespace, name = meta.get("namespace"), meta.get("name")
        if not namespace or not name:
            return
        if event == "DELETED":
            memory.forget((namespace, name))
        elif not memory.changed((namespace, name), seen):
            return
        for follower in followers(index, kind, namespace, name):
            await runner.trigger(namespace, follower)

    # Enrichment: a FeatureView becoming Ready (or its server moving) re-runs the services that use it.
    views: LastSeen[tuple[Any, Any]] = LastSeen()

    @kopf.on.event(GROUP, VERSION, "featureviews")
    async def _feature_view_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        status = body.get("status") or {}
        ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        await followed_changed("FeatureView", views, body, type, (ready, status.get("url")),
                               kwargs.get(FOLLOWERS_INDEX_ID))  # fmt: skip

    # Train-to-serve: a newer checkpoint of a referenced TrainingJob rolls out by itself; a new adapter of one loads in
    # place.
    @kopf.on.event(GROUP, VERSION, "trainingjobs")
    async def _training_job_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        status = body.get("status") or {}
        seen = ((status.get("checkpoint") or {}).get("latest"), status.get("phase"))
        await followed_changed("TrainingJob", checkpoints, body, type, seen, kwargs.get(FOLLOWERS_INDEX_ID))
