"""The model source's edge and hooks: the registry an oci:// model image is looked up in (a tag to its digest, the
image checked to be a model), the TrainingJob a model comes from, MLflow (where a followed alias points, and the
writes of a canary verdict: the rejection tag, the promotion alias), and the Kopf handlers that re-run a service
when an object it follows changes (follows.py). The resolution itself is pure (model.py, alias.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import kopf

from loom.workloads.common.oci import transfer
from loom.workloads.common.oci.reference import SCHEME, ImageReference, parse_reference
from loom.workloads.common.oci.registry import Registry as ImageRegistry
from loom.workloads.common.oci.registry import RegistryError as ImageRegistryError

from ....core import client as kube
from ....core.kit import Event
from ....core.model import API_VERSION, GROUP, REJECTED_TAG, VERSION, format_time
from ....core.registry import Registry, RegistryError
from ....core.runner import LastSeen
from ....defaults import EndpointDefaults, model_problem, training_job_manifest
from ..api import InferenceServiceSpec, InferenceServiceStatus
from ..canary.api import RolloutStatus
from ..feature import Feature, Observed, Plan, ServicePass
from .alias import change_reason, due, followed, mlflow_version, previous_alias, restore_target
from .api import AliasStatus, ModelSource
from .follows import Followed, followers, index_entries
from .model import ModelRef, ResolveError, resolve_model

PLURAL = "inferenceservices"
FOLLOWERS_INDEX_ID = "loom_inferenceservice_followers"  # (kind, namespace, name) -> the services following it


# What each failure of the registry means for the service: a condition's reason, and whether to wait it out.
IMAGE_ERRORS = {
    "NotFound": ("ImageNotFound", True),  # it may be pushed yet
    "Unauthorized": ("RegistryUnauthorized", False),
    "NotAModel": ("NotAModelImage", False),
    "Unavailable": ("RegistryUnavailable", True),
    "Invalid": ("RegistryError", True),
}
# How long a tag's digest is trusted before the registry is asked again (a digest, once found, always).
TAG_RECHECK_S = 60.0
_images: dict[str, tuple[float, ImageReference]] = {}  # oci:// uri -> (monotonic time looked up, image by digest)


def _look_up(asked: ImageReference) -> ImageReference:
    with ImageRegistry(asked.registry, timeout=15.0) as registry:
        return transfer.resolve(asked, registry)[0]


async def resolve_image(uri: str) -> tuple[ImageReference | None, ResolveError | None]:
    """An oci:// model's image by digest, as its registry answers (a tag looked up at most every TAG_RECHECK_S; the
    image checked to be a model). When the registry cannot be reached, the digest found before is kept."""
    asked = parse_reference(uri)
    now = time.monotonic()
    known = _images.get(uri)
    if known is not None and (asked.digest is not None or now - known[0] < TAG_RECHECK_S):
        return known[1], None
    try:
        image = await asyncio.to_thread(_look_up, asked)
    except ImageRegistryError as error:
        if known is not None and error.kind == "Unavailable":
            return known[1], None
        reason, transient = IMAGE_ERRORS.get(error.kind, ("RegistryError", True))
        return None, ResolveError(reason, error.message[:300], transient=transient)
    _images[uri] = (now, image)
    return image, None


async def resolve(
    spec: InferenceServiceSpec, namespace: str, defaults: EndpointDefaults, alias_version: str | None = None
) -> tuple[ModelRef | None, ResolveError | None]:
    image = None
    if spec.model.uri is not None and spec.model.uri.startswith(SCHEME):
        if spec.model.pull_secret_name is not None:
            # A registry that asks for credentials: only the kubelet holds them (the pods' imagePullSecrets), so
            # the image is taken as the uri pins it (admission requires the digest); the pull is the check.
            image = parse_reference(spec.model.uri)
        else:
            image, error = await resolve_image(spec.model.uri)
            if error is not None:
                return None, error
    job = None
    if spec.model.from_training_job is not None:
        job = await kube.get(API_VERSION, "TrainingJob", namespace, spec.model.from_training_job.name)
        # The job's checkpoints are where it wrote them: with the operator's S3 defaults where it names none.
        job = training_job_manifest(job, defaults) if job is not None else None
    try:
        return resolve_model(spec.model, spec.serving_handler, job, spec.runtime, alias_version, image), None
    except ResolveError as err:
        return None, err


async def resolve_alias(
    source: ModelSource, previous: AliasStatus | None, now: datetime
) -> tuple[AliasStatus | None, ResolveError | None]:
    """The alias' status now (asking MLflow only when due) and the error when no version can be served."""
    target = followed(source)
    if target is None:
        return None, None
    model, alias = target
    same = previous is not None and (previous.model, previous.alias) == target
    kept = previous if same else None
    if not due(source, kept, now):
        return kept, None
    stamp = format_time(now)
    try:
        assert source.tracking_uri is not None  # defaulted from the operator's, or refused before this
        async with Registry(source.tracking_uri) as registry:
            found = await registry.by_alias(model, alias)
    except RegistryError as error:
        if kept is not None and kept.version is not None:
            return kept.model_copy(update={"checked_at": stamp, "error": str(error)[:300]}), None
        status = AliasStatus(model=model, alias=alias, checked_at=stamp, error=str(error)[:300])
        return status, ResolveError("RegistryUnavailable", str(error)[:300])
    if found is None:
        status = AliasStatus(model=model, alias=alias, checked_at=stamp, error=f"alias {alias} not found")
        return status, ResolveError("AliasNotFound", f"registered model {model} has no alias {alias}")
    if kept is not None and kept.version == found.version:
        return kept.model_copy(update={"checked_at": stamp, "error": None}), None
    return AliasStatus(
        model=model, alias=alias, version=found.version, checked_at=stamp, changed_at=stamp,
        previous_version=kept.version if kept else None,
    ), None  # fmt: skip


async def registry_writes(
    rollout: RolloutStatus,
    desired: ModelRef,
    *,
    promote_alias: str | None,
    promoted: bool,
    followed_alias: str | None = None,
    stable: ModelRef | None = None,
) -> RolloutStatus:
    """Tag the rejected version (once) and move the promotion alias (once); what was done goes into status, what
    failed is tried again by the next pass.

    A service that follows the alias it promotes (`champion`, say) reads a move of that alias as a candidate to
    judge. When the candidate is rejected the alias goes back to the version that serves (`stable`), so the
    registry never names a rejected version as the one in production (and a service created later does not serve
    it unjudged). Only while the alias still names the rejected version: a newer move is left alone.
    """
    target = mlflow_version(desired)
    if target is None or desired.tracking_uri is None:
        return rollout
    name, version = target
    rejected = list(rollout.rejected)
    untagged = any(e.model_version == version and not e.tagged for e in rejected)
    to_move = promoted and promote_alias is not None and rollout.promoted_alias != f"{promote_alias}={version}"
    if not untagged and not to_move:
        return rollout  # nothing to write: no connection to MLflow
    restore = restore_target(name, followed_alias, promote_alias, stable)
    try:
        async with Registry(desired.tracking_uri) as registry:
            for i, entry in enumerate(rejected):
                if entry.model_version == version and not entry.tagged:
                    if restore is not None:  # before the tag: a failure here leaves both to the next pass
                        current = await registry.by_alias(name, restore[0])
                        if current is not None and current.version == version:
                            await registry.set_alias(name, restore[0], restore[1])
                    await registry.set_version_tag(name, version, REJECTED_TAG, f"{entry.reason}: {entry.message}")
                    rejected[i] = entry.model_copy(update={"tagged": True})
            moved = f"{promote_alias}={version}"
            if promoted and promote_alias is not None and rollout.promoted_alias != moved:
                await registry.set_alias(name, promote_alias, version)
                rollout = rollout.model_copy(update={"promoted_alias": moved})
    except RegistryError:
        pass  # not recorded: the next pass tries again
    return rollout.model_copy(update={"rejected": rejected})



class SourceFeature(Feature):
    """spec.model: the model resolved each pass; a followed alias asked again every aliasPollSeconds."""

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        if not p.ctx.valid:
            return
        assert p.ctx.spec is not None
        missing = model_problem(p.ctx.spec)
        if missing is not None:
            seen.resolve_error = missing  # nothing can be fetched without the endpoint
            return
        seen.alias, alias_error = await resolve_alias(p.spec.model, previous_alias(p.ctx.body), p.now)
        if alias_error is not None:
            seen.resolve_error = alias_error
            return
        version = seen.alias.version if seen.alias is not None else None
        seen.desired, seen.resolve_error = await resolve(p.spec, p.ctx.namespace, p.defaults, version)

    async def after_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        if followed(p.spec.model) is not None:
            p.later(p.spec.model.alias_poll_seconds)

    def status(
        self, p: ServicePass, seen: Observed, plan: Plan, status: InferenceServiceStatus,
        previous: InferenceServiceStatus | None,
    ) -> list[Event]:
        if p.ctx.spec is not None and followed(p.ctx.spec.spec.model) is not None:
            status.alias = seen.alias or (previous.alias if previous else None)
        status.model_changed = change_reason(status.alias) or (previous.model_changed if previous else None)
        stable = plan.rollout.stable_ref
        status.model_image = stable.storage_uri if stable is not None and stable.storage_kind == "oci" else None
        return []

    def register(self, trigger: Callable[[str, str], Awaitable[None]]) -> None:
        # The TrainingJobs and FeatureViews each service follows (follows.py): looked up by the handlers below.
        @kopf.index(GROUP, VERSION, PLURAL, id=FOLLOWERS_INDEX_ID)
        async def _followers(namespace: str | None, name: str | None, spec: Any, **_: Any) -> dict[Any, str]:
            return index_entries(str(namespace), str(name), spec)

        async def followed_changed(
            kind: Followed, memory: LastSeen[tuple[Any, Any]], body: kopf.Body, event: str | None,
            seen: tuple[Any, Any], index: Any,
        ) -> None:
            """Re-run the services following `body` when the fields `seen` of it changed, or it is gone."""
            meta = body.get("metadata", {})
            namespace, name = meta.get("namespace"), meta.get("name")
            if not namespace or not name:
                return
            if event == "DELETED":
                memory.forget((namespace, name))
            elif not memory.changed((namespace, name), seen):
                return
            for follower in followers(index, kind, namespace, name):
                await trigger(namespace, follower)

        # Enrichment: a FeatureView becoming Ready (or its server moving) re-runs the services that use it.
        views: LastSeen[tuple[Any, Any]] = LastSeen()

        @kopf.on.event(GROUP, VERSION, "featureviews")
        async def _feature_view_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
            status = body.get("status") or {}
            ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
            await followed_changed("FeatureView", views, body, type, (ready, status.get("url")),
                                   kwargs.get(FOLLOWERS_INDEX_ID))  # fmt: skip

        # Train-to-serve: a newer checkpoint of a referenced TrainingJob rolls out by itself; a new adapter of one
        # loads in place. Last (checkpoint, phase) seen per job: its status changes often, only these matter here.
        checkpoints: LastSeen[tuple[Any, Any]] = LastSeen()

        @kopf.on.event(GROUP, VERSION, "trainingjobs")
        async def _training_job_changed(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
            status = body.get("status") or {}
            seen = ((status.get("checkpoint") or {}).get("latest"), status.get("phase"))
            await followed_changed("TrainingJob", checkpoints, body, type, seen, kwargs.get(FOLLOWERS_INDEX_ID))
