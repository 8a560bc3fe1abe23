"""InferenceService controller: its Reconciler on the skeleton (core/reconcile.py), the features' hooks, Kopf.

Every entry point (create/resume/spec update, the periodic resync, a change of one of our Deployments, a new
checkpoint of a referenced TrainingJob) triggers the same pass through the shared runner (core/runner.py), which
serialises, coalesces and bounds passes per object. A pass: parse -> observe (its Deployments and pods, then each
feature's reading) -> decide (pure: the replicas, each feature's part, the rollout) -> render (pure) and server-side
apply -> status (pure), written with the events by the skeleton. The features (source/, enrichment/, llm/,
canary/, queue/, traffic/) take part through the hooks of feature.py, in the order of FEATURES. Everything the
pass needs is in the cluster (the stable model is an annotation on the stable Deployment), so the operator can be
killed at any instant: the next pass converges, creating nothing twice (deterministic names, server-side apply).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import ValidationError

from ...core import client as kube
from ...core.kit import Event, Manifest, controlled_by
from ...core.model import first_error
from ...core.pod_problems import find_problem
from ...core.pods import PodIndex, pods_of
from ...core.reconcile import StatusAfterApply, run
from ...core.runner import Indexes, Runner, child_handlers, own_kind_handlers, register_pod_index
from ...defaults import Defaulted, EndpointDefaults
from ...defaults import inference_service as inference_service_defaults
from ...settings import OperatorSettings
from .api import INFERENCE_SERVICE, InferenceServiceSpec, InferenceServiceStatus
from .autoscaling.replicas import recommend_replicas
from .canary.io import CanaryFeature
from .enrichment.io import EnrichmentFeature
from .feature import Draft, Feature, Observed, Plan, ServiceCtx, ServicePass
from .llm import disaggregation, multinode
from .llm import io as llm_io
from .llm.io import LlmFeature
from .llm.vllm import LLM_CONFIG_FILE
from .queue.io import QueueFeature
from .render import (
    CONFIG_DIR,
    CONFIG_HASH_ANNOTATION,
    KIND_LABEL,
    InvalidSpec,
    ModelNodeCache,
    Track,
    config_map_name,
    deployment_name,
    render_deployment,
    rollout_strategy,
    selector_string,
    server_config,
    server_selector,
)
from .rollout import RolloutPlan, desired_total_replicas, plan_rollout
from .source.io import SourceFeature
from .status import Observed as StatusObserved
from .status import compute_status
from .traffic.io import TrafficFeature

PLURAL = "inferenceservices"
KIND = "InferenceService"
INDEX_ID = "loom_inferenceservices"
POD_INDEX_ID = "loom_inferenceservice_pods"

# In the order their hooks run: the model first (the others read what it resolved), the canary after the model
# and its features (it judges the model they leave), the routing last (it applies before the tracks, after the
# canary's verdict is persisted).
FEATURES: tuple[Feature, ...] = (
    SourceFeature(), EnrichmentFeature(), LlmFeature(), CanaryFeature(), QueueFeature(), TrafficFeature(),
)


def _template_hash(deployment: Manifest | None) -> str | None:
    if deployment is None:
        return None
    annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
    return annotations.get(CONFIG_HASH_ANNOTATION)


def _replicas(deployment: Manifest | None, field: str = "replicas") -> int:
    return int((deployment or {}).get("spec", {}).get(field, 0))


class ServiceReconciler(StatusAfterApply):
    kind: ClassVar[str] = KIND
    status_model: ClassVar[type[Any]] = InferenceServiceStatus

    def __init__(
        self,
        settings: OperatorSettings,
        pods: PodIndex | None = None,
        later: Callable[[str, str, float], None] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        features: Sequence[Feature] = FEATURES,
    ) -> None:
        self.settings = settings
        self.pods = pods
        self.defaults = EndpointDefaults.from_settings(settings)
        self.later = later  # asks the runner for another pass in that many seconds (the analysis' next check)
        self.now = now
        self.features = features
        self._pass: ServicePass | None = None

    def _hooks(self, ctx: ServiceCtx) -> ServicePass:
        """The hooks' view of this pass (one clock reading per pass, as each step used to read it once)."""
        if self._pass is None or self._pass.ctx is not ctx:
            later = self.later

            def again(delay_s: float) -> None:
                if later is not None:
                    later(ctx.namespace, ctx.name, delay_s)

            self._pass = ServicePass(ctx, self.settings, self.defaults, self.now(), again, self.pods)
        return self._pass

    def parse(self, body: Manifest) -> Defaulted[InferenceServiceSpec]:
        # The operator's endpoint defaults fill what the spec leaves unset (defaults.py).
        return inference_service_defaults(InferenceServiceSpec.model_validate(body.get("spec") or {}), self.defaults)

    def check(self, body: Manifest, spec: Defaulted[InferenceServiceSpec]) -> None:
        rollout_strategy(spec.spec)  # raises InvalidSpec for what admission cannot catch
        if (name_problem := INFERENCE_SERVICE.name_rule.problem(body["metadata"]["name"])) is not None:
            raise InvalidSpec(name_problem)  # the CRD refuses it now
        for feature in self.features:
            if (problem := feature.check(body, spec.spec)) is not None:
                raise InvalidSpec(problem)

    async def observe(self, ctx: ServiceCtx) -> Observed:
        namespace, name = ctx.namespace, ctx.name
        grouped = ctx.spec is not None and multinode.grouped(ctx.spec.spec)
        split = ctx.spec is not None and disaggregation.disaggregated(ctx.spec.spec)
        seen = Observed(
            stable=await _read_track(namespace, deployment_name(name, "stable"), grouped, split),
            canary=await _read_track(namespace, deployment_name(name, "canary"), grouped, split),
        )
        # The serving pods from the pod index (Kopf's watch cache; populated before any pass runs), a LIST only
        # when a pass runs without it.
        seen.pods = (
            pods_of(self.pods, namespace, name, server_selector(ctx.owner)) if self.pods is not None
            else await kube.list_objects("v1", "Pod", namespace, selector_string(ctx.owner))
        )
        if ctx.spec is not None:
            hooks = self._hooks(ctx)
            for feature in self.features:
                await feature.observe(hooks, seen)
        return seen

    def decide(self, ctx: ServiceCtx, observed: Observed) -> Plan:
        if ctx.spec is None:
            return Plan(observed.plan, ctx.invalid)
        spec, stable, canary = ctx.spec.spec, observed.stable, observed.canary
        running = _replicas(stable) + _replicas(canary)
        total = desired_total_replicas(spec, recommend_replicas(spec, running) if spec.autoscaling else None)
        invalid = ctx.invalid
        if invalid is None and observed.desired is not None:
            try:
                server_config(ctx.owner, spec, observed.desired, observed.features)  # the server's own contract
            except (InvalidSpec, ValidationError) as exc:
                invalid = first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        # Invalid, or without its FeatureView (not found, not Ready): touch nothing, report what still runs; a
        # running server keeps the features it was rendered with, none is rendered without them.
        blocked = invalid is not None or observed.features_error is not None
        draft = Draft(total=total, run=None if blocked else observed.desired, blocked=blocked)
        hooks = self._hooks(ctx)
        for feature in self.features:
            feature.decide(hooks, observed, draft)
        rollout = plan_rollout(spec, draft.run, stable, canary, draft.total, draft.percent, draft.reject_canary)
        applies = not blocked and rollout.stable_ref is not None
        return Plan(rollout, invalid, draft.judgement, draft.admission, applies)

    async def apply(self, ctx: ServiceCtx, observed: Observed, plan: Plan) -> Observed:
        hooks = self._hooks(ctx)
        observed.plan = plan.rollout
        for feature in self.features:
            await feature.before_apply(hooks, observed, plan)
        if plan.applies:
            observed.stable, observed.canary, observed.plan = await _apply(hooks, observed, plan, self.features)
        for feature in self.features:
            await feature.after_apply(hooks, observed, plan)
        return observed

    def status(
        self,
        ctx: ServiceCtx,
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
        status.endpoint_defaults = ctx.spec.status_field() if ctx.spec is not None else None
        hooks = self._hooks(ctx)
        for feature in self.features:
            events = [*events, *feature.status(hooks, observed, plan, status, previous)]
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


async def _read_track(namespace: str, name: str, grouped: bool, split: bool = False) -> Manifest | None:
    """A track's workload: its Deployment, or with multi-pod replicas its LeaderWorkerSet in a Deployment's words
    (llm/multinode.py), or disaggregated its prefill and decode pools (llm/disaggregation.py); another shape when
    the spec's is absent (the track runs as before until it is replaced)."""
    if split and (pools := await llm_io.read_pools(namespace, name)) is not None:
        return pools
    lws = (multinode.LWS_API_VERSION, multinode.LWS_KIND)
    for api_version, kind in (lws, ("apps/v1", "Deployment")) if grouped else (("apps/v1", "Deployment"), lws):
        found = await kube.get(
            api_version, kind, namespace, multinode.group_set_name(name) if kind == multinode.LWS_KIND else name
        )
        if found is not None:
            return multinode.deployment_view(found) if kind == multinode.LWS_KIND else found
    return None if split else await llm_io.read_pools(namespace, name)


def model_node_cache(settings: OperatorSettings) -> ModelNodeCache | None:
    if settings.model_node_cache_dir is None:
        return None
    return ModelNodeCache(settings.model_node_cache_dir, settings.model_node_cache_limit_bytes)


async def _apply_track(
    p: ServicePass, seen: Observed, plan: Plan, features: Sequence[Feature], track: Track, replicas: int
) -> Manifest:
    ref = plan.rollout.stable_ref if track == "stable" else plan.rollout.canary_ref
    assert ref is not None
    adapters = seen.adapters.to_list() if seen.adapters is not None else None
    config_map, deployment = render_deployment(
        p.ctx.owner, p.spec, track, ref, replicas, p.settings.server_image, seen.features, p.settings.vllm_image,
        adapters, model_node_cache(p.settings),
    )  # fmt: skip
    for feature in features:
        feature.render(p, seen, plan, track, deployment)
    await kube.apply(config_map)  # before the Deployment: new pods must find their config
    name = deployment["metadata"]["name"]
    if disaggregation.disaggregated(p.spec):
        pools = await llm_io.apply_pools(deployment, p.spec)
        await _delete_other_shapes(p.ctx.owner, name, keep=disaggregation.VIEW_KIND)
        return pools
    if multinode.grouped(p.spec):
        applied = multinode.deployment_view(
            await kube.apply(multinode.leader_worker_set(deployment, p.spec, f"{CONFIG_DIR}/{LLM_CONFIG_FILE}"))
        )
        assert applied is not None
        await _delete_other_shapes(p.ctx.owner, name, keep=multinode.LWS_KIND)
        return applied
    applied = await kube.apply(deployment)
    await _delete_other_shapes(p.ctx.owner, name, keep="Deployment")
    return applied


async def _delete_other_shapes(owner: Manifest, track_deployment: str, keep: str) -> None:
    """A track runs as one shape: a Deployment, a LeaderWorkerSet group (llm/multinode.py) or prefill and decode
    pools (llm/disaggregation.py). Once the spec's shape is applied, the others go. They are looked for on every pass,
    not only when the pass read the track as another shape: an operator killed between the apply and the delete
    leaves the old shape behind, and the next pass reads the track as the new one. The lookups are in the watch cache
    (Deployments and LeaderWorkerSets labelled as Loom's; an absent one costs no request). Only this service's own
    objects go (kit.controlled_by: the service `a` must not delete the Deployment of a service named `a-decode`)."""
    namespace = owner["metadata"]["namespace"]
    shapes: dict[str, list[tuple[str, str, str]]] = {
        "Deployment": [("apps/v1", "Deployment", track_deployment)],
        multinode.LWS_KIND: [
            (multinode.LWS_API_VERSION, multinode.LWS_KIND, multinode.group_set_name(track_deployment))
        ],
        disaggregation.VIEW_KIND: [
            ("apps/v1", "Deployment", disaggregation.pool_name(track_deployment, role))
            for role in disaggregation.ROLES
        ],
    }
    for shape, objects in shapes.items():
        if shape == keep:
            continue
        for api_version, kind, object_name in objects:
            found = await kube.get(api_version, kind, namespace, object_name)
            if found is not None and controlled_by(found, owner):
                await kube.delete(api_version, kind, namespace, object_name, uid=found["metadata"].get("uid"))


async def _retire_canary(namespace: str, name: str, canary: Manifest | None) -> None:
    # ConfigMap first: if the operator dies in between, the Deployment is still there to retire next pass.
    await kube.delete("v1", "ConfigMap", namespace, config_map_name(name, "canary"))
    if canary is not None and canary.get("kind") == multinode.LWS_KIND:
        group_set = multinode.group_set_name(deployment_name(name, "canary"))
        await kube.delete(multinode.LWS_API_VERSION, multinode.LWS_KIND, namespace, group_set)
    else:
        await kube.delete("apps/v1", "Deployment", namespace, deployment_name(name, "canary"))


async def _apply(
    p: ServicePass, seen: Observed, plan: Plan, features: Sequence[Feature]
) -> tuple[Manifest | None, Manifest | None, RolloutPlan]:
    """The tracks: the stable one, then the canary applied, kept or retired."""
    rollout, canary = plan.rollout, seen.canary
    stable = await _apply_track(p, seen, plan, features, "stable", rollout.stable_replicas)
    if rollout.canary_action == "apply":
        canary = await _apply_track(p, seen, plan, features, "canary", rollout.canary_replicas)
    elif rollout.canary_action == "keep":
        # Judge the stable track as it is after this apply: a no-op apply may show it already rolled out.
        settled = plan_rollout(p.spec, rollout.stable_ref, stable, canary, rollout.stable_replicas)
        if settled.canary_action == "retire":
            rollout = settled
    if rollout.canary_action == "retire":
        await _retire_canary(p.ctx.namespace, p.ctx.name, canary)
        canary = None
        rollout = RolloutPlan(stable_ref=rollout.stable_ref, stable_replicas=rollout.stable_replicas)  # steady now
    return stable, canary, rollout


def register(settings: OperatorSettings) -> None:
    indexes = Indexes(POD_INDEX_ID)

    async def one_pass(namespace: str, name: str) -> None:
        await reconcile(namespace, name, settings, indexes.get(POD_INDEX_ID), runner.later)

    runner = Runner(KIND, one_pass, interval_s=settings.resync_interval_s, timeout_s=settings.reconcile_timeout_s)

    # Spec changes, and the resync: the safety net that converges status and corrects drift even after a
    # missed watch event. Children go with the object (ownerReferences): no finalizer.
    own_kind_handlers(runner, PLURAL, INDEX_ID)

    # The activator's pods, for why one cannot start: a watch cache bound once at start-up, not a LIST per pass.
    register_pod_index(KIND_LABEL, POD_INDEX_ID)
    indexes.register()

    # Rollouts progress with the Deployments' status: react to it instead of polling.
    # Multi-pod replicas: their LeaderWorkerSets' (llm/multinode.py; no events where LWS is not installed).
    child_handlers(
        runner, KIND_LABEL, ("apps", "v1", "deployments"), ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
    )

    # What re-runs a service besides its own objects: the objects it follows, its Kueue Workloads.
    for feature in FEATURES:
        feature.register(runner.trigger)
