"""The builtin autoscaler's view of an InferenceGraph (autoscale/adapters.py): spec.router.autoscaling; replicas go to
its own scale subresource (spec.router.replicas), from which the reconcile pass renders the router Deployment (a
write to the Deployment itself would be undone by the next server-side apply, and the scale subresource gives the
write a resourceVersion precondition and a reconcile trigger, exactly as for an InferenceService).
"""

from __future__ import annotations

from pydantic import ValidationError

from ....autoscale.adapters import Engines, Target, clamp, raw_block, scale_self
from ....core.kit import Manifest, owner_of
from ..api import InferenceGraphSpec
from ..render import selector_string


class InferenceGraphAdapter:
    kind, plural = "InferenceGraph", "inferencegraphs"
    engines: Engines | None = None

    def autoscaling(self, spec: Manifest) -> object | None:
        return raw_block(spec, "router", "autoscaling")

    async def target(self, body: Manifest) -> Target | None:
        try:
            spec = InferenceGraphSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None
        autoscaling = spec.router.autoscaling
        if autoscaling is None:
            return None
        body = {**body, "kind": self.kind}
        selector = selector_string(owner_of(body, self.kind))
        return scale_self(body, autoscaling, clamp(spec.router.replicas, autoscaling), selector)


ADAPTER = InferenceGraphAdapter()
