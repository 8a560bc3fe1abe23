"""The builtin autoscaler's view of a FeatureView (autoscale/adapters.py): spec.server.autoscaling of the project's
oldest view (of those in its config) that sets one; one Deployment serves every view of a project, so no view owns
its replicas: they go to the feature server Deployment's scale subresource, and the reconcile pass keeps the
Deployment's replicas while it is autoscaled. Status and events go on the view whose autoscaling is in force.
"""

from __future__ import annotations

from pydantic import ValidationError

from ....autoscale.adapters import Engines, Target, raw_block
from ....autoscale.spec import Autoscaling
from ....core import client as kube
from ....core.kit import Manifest, selector
from ....core.model import API_VERSION
from ..api import FeatureViewSpec
from ..config import Member, plan_project, project_object_name
from ..render import server_selector


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
    kind, plural = "FeatureView", "featureviews"
    engines: Engines | None = None

    def autoscaling(self, spec: Manifest) -> object | None:
        return raw_block(spec, "server", "autoscaling")

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
                members.append(Member(m["name"], m["uid"], m.get("creationTimestamp") or "", other, m["namespace"]))
        chosen = project_autoscaling(members)
        if chosen is None or chosen[0] != meta["name"]:
            return None  # another view's autoscaling is in force for the project's server
        name = project_object_name(spec.project)
        deployment = await kube.get("apps/v1", "Deployment", namespace, name)
        if deployment is None:
            return None  # the reconcile pass has not created the server yet
        autoscaling = chosen[1]
        replicas = int((deployment.get("spec") or {}).get("replicas") or 0)
        pods = selector(server_selector(spec.project))
        rv = str(deployment["metadata"]["resourceVersion"])
        # Not clamped: a count outside the bounds (a view's autoscaling just set) is brought back by the decision.
        return Target(autoscaling, replicas, pods, "apps/v1", "Deployment", name, rv)


ADAPTER = FeatureViewAdapter()
