"""InferenceService controller: thin Kopf handlers around one idempotent `reconcile`.

Every entry point (create/resume/spec update, the periodic resync, a change of one of our Deployments, a new
checkpoint of a referenced TrainingJob) triggers the same pass through the shared runner (runner.py), which
serialises, coalesces and bounds passes per object. A pass: read -> resolve the model -> plan (pure) -> render
(pure) -> server-side apply -> status (pure) -> status patch + events. Everything the pass needs is in the
cluster (the stable model is an annotation on the stable Deployment), so the operator can be killed at any
instant: the next pass converges, creating nothing twice (deterministic names, server-side apply).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from pydantic import ValidationError

from loom.workloads.server.config import EnrichmentConfig

from ..api import GROUP, VERSION
from ..api.inferenceservice import InferenceServiceSpec, InferenceServiceStatus
from ..api.kinds import INFERENCE_SERVICE
from ..autoscale.inferenceservice import recommend_replicas
from ..kube import client as kube
from ..render.defaults import Defaulted, EndpointDefaults, model_problem, training_job_manifest
from ..render.defaults import inference_service as inference_service_defaults
from ..render.inferenceservice import (
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
)
from ..render.inferenceservice_activator import activator_enabled, activator_selector
from ..render.inferenceservice_features import resolve_features
from ..render.inferenceservice_model import ModelRef, ResolveError, resolve_model
from ..render.inferenceservice_rollout import RolloutPlan, desired_total_replicas, plan_rollout
from ..render.inferenceservice_status import Observed, compute_status
from ..render.kit import Manifest, owner_of, status_patch
from ..render.pod_problems import find_problem
from ..settings import OperatorSettings
from .events import post_events
from .inferenceservice_activator import apply_routing
from .runner import LastSeen, Runner, child_handlers, own_kind_handlers

log = logging.getLogger("loom.operator.inferenceservice")

API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "inferenceservices"
KIND = "InferenceService"
INDEX_ID = "loom_inferenceservices"


async def _resolve(
    spec: InferenceServiceSpec, namespace: str, defaults: EndpointDefaults
) -> tuple[ModelRef | None, ResolveError | None]:
    job = None
    if spec.model.from_training_job is not None:
        job = await kube.get(API_VERSION, "TrainingJob", namespace, spec.model.from_training_job.name)
        # The job's checkpoints are where it wrote them: with the operator's S3 defaults where it names none.
        job = training_job_manifest(job, defaults) if job is not None else None
    try:
        return resolve_model(spec.model, spec.handler, job), None
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
    features: EnrichmentConfig | None = None,
) -> Manifest:
    config_map, deployment = render_deployment(owner, spec, track, ref, replicas, image, features)
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


async def reconcile(namespace: str, name: str, settings: OperatorSettings) -> None:
    """One full pass for one InferenceService, read fresh (the runner serialises passes per object, so a pass
    sees the status the previous one wrote and announces each transition once)."""
    body = await kube.get(API_VERSION, KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    owner = owner_of(body, KIND)
    previous = _previous_status(body)
    stable = await kube.get("apps/v1", "Deployment", namespace, deployment_name(name, "stable"))
    canary = await kube.get("apps/v1", "Deployment", namespace, deployment_name(name, "canary"))
    invalid: str | None = None
    resolve_error: ResolveError | None = None
    features: EnrichmentConfig | None = None
    features_error: ResolveError | None = None
    plan = RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting")
    defaulted: Defaulted[InferenceServiceSpec] | None = None
    try:
        # The operator's endpoint defaults fill what the spec leaves unset (render/defaults.py).
        defaulted = inference_service_defaults(
            InferenceServiceSpec.model_validate(body.get("spec") or {}), EndpointDefaults.from_settings(settings)
        )
        spec: InferenceServiceSpec | None = defaulted.spec
    except ValidationError as exc:
        spec, invalid = None, _short(exc)
    if spec is not None:
        running = sum(int((d or {}).get("spec", {}).get("replicas", 0)) for d in (stable, canary))
        total = desired_total_replicas(spec, recommend_replicas(spec, running) if spec.autoscaling else None)
        try:
            rollout_strategy(spec)  # raises InvalidSpec for what admission cannot catch
            if (name_problem := INFERENCE_SERVICE.name_rule.problem(name)) is not None:  # the CRD refuses it now
                raise InvalidSpec(name_problem)
            missing = model_problem(defaulted) if defaulted is not None else None
            if missing is not None:
                desired, resolve_error = None, missing  # nothing can be fetched without the endpoint
            else:
                desired, resolve_error = await _resolve(spec, namespace, EndpointDefaults.from_settings(settings))
            features, features_error = await _features(spec, namespace)
            if features_error is not None:
                desired, resolve_error = None, resolve_error or features_error
            if desired is not None:
                # the server's own contract may refuse what the CRD allows
                server_config(owner, spec, desired, features)
        except (InvalidSpec, ValidationError) as exc:
            invalid = _short(exc)
        if invalid is not None or features_error is not None:
            # Touch nothing; report what still runs. Without its FeatureView (not found, not Ready) a running
            # server keeps the features it was rendered with; none is rendered without them.
            plan = plan_rollout(spec, None, stable, canary, total)
        else:
            plan = plan_rollout(spec, desired, stable, canary, total)
            if plan.stable_ref is not None:
                stable, canary, plan = await _apply(owner, spec, plan, stable, canary, settings, features)
    serving_track: Track = "canary" if plan.canary_action == "apply" else "stable"
    pods = await kube.list_objects("v1", "Pod", namespace, selector_string(owner))
    # The scale-to-zero activator's pods (when it runs): one that cannot start is named in Ready at zero.
    activator = ",".join(f"{k}={v}" for k, v in sorted(activator_selector(owner).items()))
    held = await kube.list_objects("v1", "Pod", namespace, activator) if spec and activator_enabled(spec) else []
    observed = Observed(
        plan=plan,
        stable=stable,
        canary=canary,
        pods=pods,
        serving_config_hash=_template_hash(canary if serving_track == "canary" else stable),
        resolve_error=resolve_error,
        invalid=invalid,
        activator_problem=find_problem(held),
    )
    status, events = compute_status(owner, observed, previous)
    status.endpoint_defaults = defaulted.status_field() if defaulted is not None else None
    patch = status_patch(dict(body.get("status") or {}), status.to_wire())
    if patch is not None:
        await kube.patch_status(API_VERSION, KIND, namespace, name, patch)
    post_events(body, events)


async def _apply(
    owner: Manifest,
    spec: InferenceServiceSpec,
    plan: RolloutPlan,
    stable: Manifest | None,
    canary: Manifest | None,
    settings: OperatorSettings,
    features: EnrichmentConfig | None = None,
) -> tuple[Manifest | None, Manifest | None, RolloutPlan]:
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    image = settings.server_image
    assert plan.stable_ref is not None
    # The Service, selecting the scale-to-zero activator while no replica is Ready (and the activator itself).
    await apply_routing(owner, spec, plan, stable, canary, settings)
    stable = await _apply_track(owner, spec, "stable", plan.stable_ref, plan.stable_replicas, image, features)
    if plan.canary_action == "apply":
        assert plan.canary_ref is not None
        canary = await _apply_track(
            owner, spec, "canary", plan.canary_ref, plan.canary_replicas, image, features
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


def _previous_status(body: Manifest) -> InferenceServiceStatus | None:
    try:
        return InferenceServiceStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return None  # a status written by another version: start the conditions afresh


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"spec.{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return str(exc)


def register(settings: OperatorSettings) -> None:
    async def one_pass(namespace: str, name: str) -> None:
        await reconcile(namespace, name, settings)

    runner = Runner(KIND, one_pass, interval_s=settings.resync_interval_s, timeout_s=settings.reconcile_timeout_s)
    # Last (checkpoint, phase) seen per TrainingJob: a job's status changes often, only these matter here.
    checkpoints: LastSeen[tuple[Any, Any]] = LastSeen()

    # Spec changes, and the resync: the safety net that converges status and corrects drift even after a
    # missed watch event. Children go with the object (ownerReferences): no finalizer.
    own_kind_handlers(runner, PLURAL, INDEX_ID)

    # Rollouts progress with the Deployments' status: react to it instead of polling.
    child_handlers(runner, KIND_LABEL, ("apps", "v1", "deployments"))

    # Enrichment: a FeatureView becoming Ready (or its server moving) re-runs the services that use it.
    views: LastSeen[tuple[Any, Any]] = LastSeen()

    @kopf.on.event(GROUP, VERSION, "featureviews")
    async def _feature_view_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        meta = body.get("metadata", {})
        namespace, view = meta.get("namespace"), meta.get("name")
        if not namespace or not view:
            return
        status = body.get("status") or {}
        ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        if type == "DELETED":
            views.forget((namespace, view))
        elif not views.changed((namespace, view), (ready, status.get("url"))):
            return
        for isvc in await kube.list_objects(API_VERSION, KIND, namespace):
            if ((isvc.get("spec") or {}).get("features") or {}).get("featureView") == view:
                await runner.trigger(namespace, isvc["metadata"]["name"])

    # Train-to-serve: a newer checkpoint of a referenced TrainingJob rolls out by itself.
    @kopf.on.event(GROUP, VERSION, "trainingjobs")
    async def _training_job_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        meta = body.get("metadata", {})
        namespace, job = meta.get("namespace"), meta.get("name")
        if not namespace or not job:
            return
        status = body.get("status") or {}
        seen = ((status.get("checkpoint") or {}).get("latest"), status.get("phase"))
        if type == "DELETED":
            checkpoints.forget((namespace, job))
        elif not checkpoints.changed((namespace, job), seen):
            return
        for isvc in await kube.list_objects(API_VERSION, KIND, namespace):
            source = ((isvc.get("spec") or {}).get("model") or {}).get("fromTrainingJob") or {}
            if source.get("name") == job:
                await runner.trigger(namespace, isvc["metadata"]["name"])
