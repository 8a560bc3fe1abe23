"""Traffic's edge and hooks (TrafficFeature): applying an InferenceService's routing, the scale-to-zero activator
(activator.py) and the endpoint picker of a vllm service with several replicas (picker.py).

Applied before the tracks, in place of applying the Service alone. Order matters for traffic: the activator's
and the picker's objects go first and then the Service (which may select their pod); without them, the Service
goes back to the model servers first and then their objects are deleted. The Service selects the picker only
once the picker's Deployment reports a Ready replica (read from the apply's answer: no extra GET).
"""

from __future__ import annotations

from ....core import client as kube
from ....core.kit import Manifest
from ....core.pods import pods_of
from ....settings import OperatorSettings
from ..api import InferenceServiceSpec
from ..feature import Feature, Observed, Plan, ServicePass
from ..rollout import RolloutPlan
from .activator import (
    activator_config,
    activator_enabled,
    activator_name,
    activator_selector,
    render_activator,
    render_routed_service,
    routes_to_activator,
)
from .picker import picker_config, picker_name, picker_policy, render_picker, service_selector
from .proxy import OBJECTS


def _ready(deployment: Manifest | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


async def _delete_proxy(namespace: str, child: str) -> None:
    """Delete a proxy's objects (proxy.OBJECTS) if its Deployment is there: one read when there is none."""
    if await kube.get("apps/v1", "Deployment", namespace, child) is not None:
        for api_version, kind in OBJECTS:
            await kube.delete(api_version, kind, namespace, child)


async def apply_routing(
    owner: Manifest,
    spec: InferenceServiceSpec,
    plan: RolloutPlan,
    stable: Manifest | None,
    canary: Manifest | None,
    settings: OperatorSettings,
) -> bool:
    """Apply the activator (when the service scales to zero) and the Service; True when it routes to the activator."""
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    enabled = activator_enabled(spec)
    if enabled:
        config = activator_config(
            owner, timeout_seconds=settings.activator_timeout_s, max_held=settings.activator_max_held
        )
        for manifest in render_activator(owner, settings.server_image, config):
            await kube.apply(manifest)
    policy = picker_policy(spec)
    picker_ready = False
    if policy is not None:
        applied: Manifest | None = None
        for manifest in render_picker(owner, settings.server_image, picker_config(owner, spec, policy)):
            applied = await kube.apply(manifest)
        picker_ready = _ready(applied) > 0
    wanted = plan.stable_replicas + plan.canary_replicas
    to_activator = routes_to_activator(enabled, wanted, _ready(stable) + _ready(canary))
    service = render_routed_service(owner, to_activator)
    selector = service_selector(owner, to_activator, picker_ready)
    if selector is not None:
        service["spec"]["selector"] = selector
    await kube.apply(service)
    if not enabled:
        await _delete_proxy(namespace, activator_name(name))
    # Only a vllm service can have had a picker (no GET per pass for the others; a runtime changed away from
    # vllm leaves its idle picker until the service is deleted, when the garbage collector takes it).
    had_picker = policy is None and spec.runtime == "vllm"
    if had_picker:
        await _delete_proxy(namespace, picker_name(name))
    return to_activator


class TrafficFeature(Feature):
    """The Service, the scale-to-zero activator (autoscaling.minReplicas 0) and the endpoint picker (spec.routing)."""

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        # The activator's pods (when it runs): one that cannot start is named in Ready at zero.
        if activator_enabled(p.spec):
            seen.activator_pods = pods_of(p.pods, p.ctx.namespace, p.ctx.name, activator_selector(p.ctx.owner))

    async def before_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        # Before the tracks: the Service selects the activator while no replica is Ready.
        if plan.applies:
            await apply_routing(p.ctx.owner, p.spec, plan.rollout, seen.stable, seen.canary, p.settings)
