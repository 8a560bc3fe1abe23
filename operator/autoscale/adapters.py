"""What the builtin autoscaler (autoscaler.py) needs to know about each kind it scales: a small adapter per kind.

The loop, the Prometheus query, the pure decision, the status and the events are the same for every kind; an
adapter only says, for one object read from the API server,
- whether it is autoscaled now and by which `Autoscaling` (None: not this object's business this round),
- how many replicas it asks for now and which pods are its replicas (a label selector),
- where a new replica count is written, with which resourceVersion as a precondition.

- InferenceService: spec.autoscaling; replicas go to its own scale subresource (spec.replicas), from which the
  reconcile pass renders the stable and canary Deployments.
- InferenceGraph: spec.router.autoscaling; replicas go to its own scale subresource (spec.router.replicas), from
  which the reconcile pass renders the router Deployment (a write to the Deployment itself would be undone by the
  next server-side apply, and the scale subresource gives the write a resourceVersion precondition and a reconcile
  trigger, exactly as for an InferenceService).
- FeatureView: spec.server.autoscaling of the project's oldest view (of those in its config) that sets one; one
  Deployment serves every view of a project, so no view owns its replicas: they go to the feature server
  Deployment's scale subresource, and the reconcile pass keeps the Deployment's replicas while it is autoscaled.

Status (status.autoscaling, MetricsAvailable) and events go on the object itself; for a FeatureView on the view whose
autoscaling is in force.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import ValidationError

from ..core import client as kube
from ..core.kit import Manifest, owner_of
from ..core.model import API_VERSION
from ..kinds.featureview.api import FeatureViewSpec
from ..kinds.featureview.config import Member, plan_project, project_object_name
from ..kinds.featureview.render import server_selector
from ..kinds.inferencegraph import render as graph_render
from ..kinds.inferencegraph.api import InferenceGraphSpec
from ..kinds.inferenceservice.api import Autoscaling, InferenceServiceSpec
from ..kinds.inferenceservice.render import selector_string as isvc_selector
from ..kinds.inferenceservice.scaling import current_replicas as isvc_current_replicas


@dataclass(frozen=True)
class Target:
    """One autoscaled object as this round sees it."""

    autoscaling: Autoscaling
    current_replicas: int  # asked for now (ready + starting)
    selector: str  # label selector of its replicas' pods
    # Where a new count goes: the scale subresource of (apiVersion, kind, name), with this resourceVersion.
    scale_api_version: str
    scale_kind: str
    scale_name: str
    scale_resource_version: str


def clamp(replicas: int, autoscaling: Autoscaling) -> int:
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, replicas))


class KindAdapter(Protocol):
    kind: str
    plural: str
    engines: bool  # whether engines keda and hpa are possible (else builtin only)

    def autoscaling(self, spec: Manifest) -> object | None:
        """The raw autoscaling block of a raw spec (the index must not fail on a spec that does not validate)."""

    async def target(self, body: Manifest) -> Target | None:
        """The object's autoscaling target now, or None when it is not autoscaled (or another object speaks for
        its replicas)."""


def _raw(spec: Manifest, *path: str) -> object | None:
    node: object = spec
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _scale_self(body: Manifest, autoscaling: Autoscaling, current: int, selector: str) -> Target:
    meta = body["metadata"]
    return Target(
        autoscaling, current, selector, API_VERSION, str(body.get("kind")), meta["name"], meta["resourceVersion"]
    )


class InferenceServiceAdapter:
    kind, plural, engines = "InferenceService", "inferenceservices", True

    def autoscaling(self, spec: Manifest) -> object | None:
        return _raw(spec, "autoscaling")

    async def target(self, body: Manifest) -> Target | None:
        try:
            spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None  # the reconcile pass reports an invalid spec
        if spec.autoscaling is None:
            return None
        body = {**body, "kind": self.kind}
        selector = isvc_selector(owner_of(body, self.kind))
        return _scale_self(body, spec.autoscaling, isvc_current_replicas(spec), selector)


class InferenceGraphAdapter:
    kind, plural, engines = "InferenceGraph", "inferencegraphs", False

    def autoscaling(self, spec: Manifest) -> object | None:
        return _raw(spec, "router", "autoscaling")

    async def target(self, body: Manifest) -> Target | None:
        try:
            spec = InferenceGraphSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None
        autoscaling = spec.router.autoscaling
        if autoscaling is None:
            return None
        body = {**body, "kind": self.kind}
        selector = graph_render.selector_string(owner_of(body, self.kind))
        return _scale_self(body, autoscaling, clamp(spec.router.replicas, autoscaling), selector)


def project_autoscaling(members: list[Member]) -> tuple[str, Autoscaling] | None:
    """The view whose server autoscaling is in force for a project, and that autoscaling: the oldest view of the
    project's plan (the views that joined its config) that sets one."""
    if not members:
        return None
    for member in plan_project(members[0].spec.project, members).members:
        if member.spec.server.autoscaling is not None:
            return member.name, member.spec.server.autoscaling
    return None


class FeatureViewAdapter:
    kind, plural, engines = "FeatureView", "featureviews", False

    def autoscaling(self, spec: Manifest) -> object | None:
        return _raw(spec, "server", "autoscaling")

    async def target(self, body: Manifest) -> Target | None:
        meta = body["metadata"]
        try:
            spec = FeatureViewSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None
        if spec.server.autoscaling is None:
            return None
        namespace = meta["namespace"]
        members: list[Member] = []
        for obj in await kube.list_objects(API_VERSION, self.kind, namespace):
            if obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                other = FeatureViewSpec.model_validate(obj.get("spec") or {})
            except ValidationError:
                continue
            if other.project == spec.project:
                m = obj["metadata"]
                members.append(Member(m["name"], m["uid"], m.get("creationTimestamp") or "", other))
        chosen = project_autoscaling(members)
        if chosen is None or chosen[0] != meta["name"]:
            return None  # another view's autoscaling is in force for the project's server
        name = project_object_name(spec.project)
        deployment = await kube.get("apps/v1", "Deployment", namespace, name)
        if deployment is None:
            return None  # the reconcile pass has not created the server yet
        autoscaling = chosen[1]
        replicas = int((deployment.get("spec") or {}).get("replicas") or 0)
        selector = ",".join(f"{k}={v}" for k, v in sorted(server_selector(spec.project).items()))
        rv = str(deployment["metadata"]["resourceVersion"])
        # Not clamped: a count outside the bounds (a view's autoscaling just set) is brought back by the decision.
        return Target(autoscaling, replicas, selector, "apps/v1", "Deployment", name, rv)


INFERENCE_SERVICE = InferenceServiceAdapter()
INFERENCE_GRAPH = InferenceGraphAdapter()
FEATURE_VIEW = FeatureViewAdapter()
ADAPTERS: tuple[KindAdapter, ...] = (INFERENCE_SERVICE, INFERENCE_GRAPH, FEATURE_VIEW)
