"""InferenceGraph controller: thin Kopf handlers around one idempotent `reconcile`.

A pass: read the graph and the InferenceServices of its namespace -> render the RouterConfig (pure; problems
become a condition, never a crash loop) -> server-side apply ConfigMap, Deployment, Service -> status (pure) ->
status patch + events. Every entry point goes through the shared runner (runner.py): create/resume/spec update,
the periodic resync, a change of the router Deployment, and a change of a referenced InferenceService (found
through an index from (namespace, service) to the graphs naming it), so readiness and model names follow the
services without polling.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from pydantic import ValidationError

from ..api import GROUP, VERSION
from ..api.inferencegraph import InferenceGraphSpec, InferenceGraphStatus
from ..kube import client as kube
from ..render.inferencegraph import (
    KIND_LABEL,
    GraphProblem,
    ServiceRef,
    deployment_name,
    observe_service,
    referenced_services,
    render_router,
    router_config,
    selector_string,
    service_conflict,
    service_name,
)
from ..render.inferencegraph_status import Observed, compute_status
from ..render.kit import Manifest, owner_of, status_patch
from ..render.pod_problems import find_problem
from ..settings import OperatorSettings
from .events import post_events
from .runner import LastSeen, Runner, child_handlers, own_kind_handlers

log = logging.getLogger("loom.operator.inferencegraph")

API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "inferencegraphs"
KIND = "InferenceGraph"
INDEX_ID = "loom_inferencegraphs"
BY_SERVICE_INDEX_ID = "loom_inferencegraphs_by_service"


async def reconcile(namespace: str, name: str, settings: OperatorSettings) -> None:
    """One full pass for one InferenceGraph, read fresh."""
    body = await kube.get(API_VERSION, KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    owner = owner_of(body, KIND)
    previous = _previous_status(body)
    services: dict[str, ServiceRef] = {}
    deployment: Manifest | None = None
    problem: GraphProblem | None = None
    try:
        spec: InferenceGraphSpec | None = InferenceGraphSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        spec, problem = None, GraphProblem("InvalidGraph", _short(exc))
    if spec is not None:
        wanted = set(referenced_services(spec))
        if wanted:
            for isvc in await kube.list_objects(API_VERSION, "InferenceService", namespace):
                if isvc["metadata"]["name"] in wanted and not isvc["metadata"].get("deletionTimestamp"):
                    ref = observe_service(isvc)
                    services[ref.name] = ref
        config, problem = router_config(owner, spec, services)
        if config is not None:
            existing = await kube.get("v1", "Service", namespace, service_name(name))
            problem = service_conflict(owner, existing)
            for manifest in render_router(owner, spec, config, settings.router_image):
                if manifest["kind"] == "Service" and problem is not None:
                    continue  # another object's Service: reported, never taken over
                applied = await kube.apply(manifest)
                if manifest["kind"] == "Deployment":
                    deployment = applied
    if deployment is None:
        deployment = await kube.get("apps/v1", "Deployment", namespace, deployment_name(name))
    # A router pod that cannot start (a missing Secret, the image, ...) is named in RouterAvailable and Ready.
    pods = await kube.list_objects("v1", "Pod", namespace, selector_string(owner)) if deployment is not None else []
    observed = Observed(deployment, services, problem, find_problem(pods))
    status, events = compute_status(owner, spec, observed, previous)
    patch = status_patch(dict(body.get("status") or {}), status.to_wire())
    if patch is not None:
        await kube.patch_status(API_VERSION, KIND, namespace, name, patch)
    post_events(body, events)


def _previous_status(body: Manifest) -> InferenceGraphStatus | None:
    try:
        return InferenceGraphStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return None  # a status written by another version: start the conditions afresh


def _short(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"spec.{where}: {first.get('msg')}" if where else str(first.get("msg"))


def services_named(spec: Manifest | None) -> set[str]:
    """serviceName of every step of a raw spec (the index must not fail on a spec that does not validate)."""
    names: set[str] = set()
    for node in ((spec or {}).get("nodes") or {}).values():
        for step in (node or {}).get("steps") or []:
            if isinstance(step, dict) and step.get("serviceName"):
                names.add(str(step["serviceName"]))
    return names


def _service_state(body: Manifest) -> tuple[Any, ...]:
    """What of an InferenceService a graph depends on: its Ready condition and the model name it serves."""
    ref = observe_service(body)
    return (ref.ready, ref.reason, ref.model_name)


def register(settings: OperatorSettings) -> None:
    async def one_pass(namespace: str, name: str) -> None:
        await reconcile(namespace, name, settings)

    runner = Runner(KIND, one_pass, interval_s=settings.resync_interval_s, timeout_s=settings.reconcile_timeout_s)
    # Last (ready, reason, model name) seen per InferenceService: its status changes often, only these matter.
    seen: LastSeen[tuple[Any, ...]] = LastSeen()

    # Spec changes, deletion and the periodic resync; children go with the object (ownerReferences): no finalizer.
    own_kind_handlers(runner, PLURAL, INDEX_ID)

    # (namespace, InferenceService) -> names of the graphs whose steps name it.
    @kopf.index(GROUP, VERSION, PLURAL, id=BY_SERVICE_INDEX_ID)
    def _by_service(namespace: str | None, name: str | None, spec: Any, **_: Any) -> dict[tuple[str, str], str]:
        return {(str(namespace), service): str(name) for service in services_named(dict(spec or {}))}

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
