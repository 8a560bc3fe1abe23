"""The builtin autoscaler's view of an InferenceService (autoscale/adapters.py): spec.autoscaling; replicas go to its
own scale subresource (spec.replicas), from which the reconcile pass renders the stable and canary Deployments.
The only kind with engines keda and hpa: their ScaledObject / HorizontalPodAutoscaler are rendered here.
"""

from __future__ import annotations

from pydantic import ValidationError

from ....autoscale.adapters import Engines, Target, raw_block, scale_self
from ....autoscale.engines import HPA_API_VERSION, KEDA_API_VERSION, render_hpa, render_scaled_object
from ....autoscale.spec import Autoscaling, scaling_config
from ....core.kit import Manifest, child_metadata, owner_of
from ....settings import OperatorSettings
from ..api import InferenceServiceSpec
from ..render import deployment_name, selector_string
from .replicas import current_replicas


def engine_object(
    owner: Manifest, autoscaling: Autoscaling, settings: OperatorSettings
) -> tuple[Manifest | None, list[tuple[str, str]]]:
    """What engine keda or hpa needs (None for builtin), and the (apiVersion, kind) of the engine objects it must
    not leave behind (a switch of engine). Raises EngineError for what the engine cannot do."""
    name = owner["metadata"]["name"]
    meta = child_metadata(owner, name, "autoscaler")
    target = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": name}
    config = scaling_config(autoscaling)
    keda, hpa = (KEDA_API_VERSION, "ScaledObject"), (HPA_API_VERSION, "HorizontalPodAutoscaler")
    if autoscaling.engine == "keda":
        deployments = [deployment_name(name, "stable"), deployment_name(name, "canary")]
        obj = render_scaled_object(
            meta,
            target,
            config,
            autoscaling.metric,
            deployments,
            prometheus_url=settings.prometheus_url or "",
            promql=autoscaling.query,
            rate_window_seconds=settings.autoscale_rate_window_s,
        )
        return obj, [hpa]
    if autoscaling.engine == "hpa":
        return render_hpa(meta, target, config, autoscaling.metric), [keda]
    return None, [keda, hpa]


class InferenceServiceEngines:
    def engine_object(
        self, owner: Manifest, autoscaling: Autoscaling, settings: OperatorSettings
    ) -> tuple[Manifest | None, list[tuple[str, str]]]:
        return engine_object(owner, autoscaling, settings)

    def starting_replicas(self, body: Manifest) -> int:
        # An HPA reads replicas 0 as "autoscaling disabled": start from what runs (minReplicas, at least 1), as a
        # Deployment's replicas default to 1.
        return max(1, current_replicas(InferenceServiceSpec.model_validate(body["spec"])))


class InferenceServiceAdapter:
    kind, plural = "InferenceService", "inferenceservices"
    engines: Engines | None = InferenceServiceEngines()

    def autoscaling(self, spec: Manifest) -> object | None:
        return raw_block(spec, "autoscaling")

    async def target(self, body: Manifest) -> Target | None:
        try:
            spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None  # the reconcile pass reports an invalid spec
        if spec.autoscaling is None:
            return None
        body = {**body, "kind": self.kind}
        selector = selector_string(owner_of(body, self.kind))
        return scale_self(body, spec.autoscaling, current_replicas(spec), selector)


ADAPTER = InferenceServiceAdapter()
