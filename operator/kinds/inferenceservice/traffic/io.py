"""Traffic's edge and hooks (TrafficFeature): applying an InferenceService's routing, the scale-to-zero activator
(activator.py) and the endpoint picker of a vllm service with several replicas (picker.py).

Applied before the tracks, in place of applying the Service alone. Order matters for traffic: the activator's
and the picker's objects go first and then the Service (which may select their pod); without them, the Service
goes back to the model servers first and then their objects are deleted. The Service selects the picker only
once the picker's Deployment reports a Ready replica (read from the apply's answer: no extra GET).
"""

from __future__ import annotations

from ....core import client as kube
from ....core.kit import Event, Manifest, condition_events
from ....core.model import Condition, set_condition
from ....core.pods import pods_of
from ....settings import OperatorSettings
from ..api import InferenceServiceSpec, InferenceServiceStatus
from ..feature import Feature, Observed, Plan, ServicePass
from ..llm.disaggregation import disaggregated
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
from .picker import picker_config, picker_name, picker_policy, picker_replicas, render_picker, service_selector
from .pool import API_VERSION as POOL_API
from .pool import CONDITION as POOL_CONDITION
from .pool import KIND as POOL_KIND
from .pool import Ownership, ownership, pool_condition, pool_name, render_inference_pool, render_picker_service
from .proxy import OBJECTS


def _ready(deployment: Manifest | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


async def _delete_proxy(namespace: str, child: str) -> None:
    """Delete a proxy's objects (proxy.OBJECTS) if its Deployment is there: one read when there is none."""
    if await kube.get("apps/v1", "Deployment", namespace, child) is not None:
        for api_version, kind in OBJECTS:
            await kube.delete(api_version, kind, namespace, child)


async def apply_pool(owner: Manifest, spec: InferenceServiceSpec, had_pool: bool) -> Ownership | None:
    """The picker's gRPC Service and the InferencePool (spec.routing.inferencePool), the pool only where none of
    someone else's stands; without it, those this service made before (`had_pool`: its status named one) go.
    Returns the pool's ownership as found (None: the service asks for no pool)."""
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    wanted = spec.routing.inference_pool if spec.routing is not None and picker_policy(spec) is not None else None
    if wanted is None:
        if had_pool:
            existing = await kube.get(POOL_API, POOL_KIND, namespace, pool_name(name))
            if ownership(existing, owner) == "ours":
                assert existing is not None
                await kube.delete(POOL_API, POOL_KIND, namespace, pool_name(name), uid=existing["metadata"]["uid"])
            await kube.delete("v1", "Service", namespace, picker_name(name))
        return None
    await kube.apply(render_picker_service(owner))
    try:
        found = ownership(await kube.get(POOL_API, POOL_KIND, namespace, pool_name(name)), owner)
        if found != "theirs":
            await kube.apply(render_inference_pool(owner, wanted.failure_mode))
    except kube.NotFound:  # a GET finds no object as None: NotFound is the kind itself missing (no CRD)
        return "no_crd"
    return found


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
        wanted_picker = picker_config(owner, spec, policy)
        for manifest in render_picker(owner, settings.server_image, wanted_picker, picker_replicas(spec)):
            applied = await kube.apply(manifest)
        picker_ready = _ready(applied) > 0
    wanted = plan.stable_replicas + plan.canary_replicas
    to_activator = routes_to_activator(enabled, wanted, _ready(stable) + _ready(canary))
    service = render_routed_service(owner, to_activator)
    selector = service_selector(owner, to_activator, picker_ready, picker_only=disaggregated(spec))
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
            had_pool = bool((p.ctx.body.get("status") or {}).get("inferencePool"))
            seen.inference_pool = await apply_pool(p.ctx.owner, p.spec, had_pool)

    def status(
        self, p: ServicePass, seen: Observed, plan: Plan, status: InferenceServiceStatus,
        previous: InferenceServiceStatus | None,
    ) -> list[Event]:
        """status.inferencePool names the pool this service made (for an HTTPRoute's backendRef); the
        InferencePool condition says whether it stands or whose one is in the way."""
        routing = p.spec.routing
        if routing is None or routing.inference_pool is None or picker_policy(p.spec) is None:
            status.conditions = [c for c in status.conditions if c.type != POOL_CONDITION]
            return []
        state = seen.inference_pool
        if state is None:  # not applied this pass (e.g. nothing resolved yet): keep what was said
            status.inference_pool = previous.inference_pool if previous is not None else None
            return []
        name = pool_name(p.ctx.name)
        status.inference_pool = name if state in ("absent", "ours") else None
        ok, reason, message = pool_condition(name, state)
        before = [c for c in (previous.conditions if previous is not None else []) if c.type == POOL_CONDITION]
        status.conditions = set_condition(status.conditions, Condition(
            type=POOL_CONDITION, status="True" if ok else "False", reason=reason, message=message,
            observed_generation=p.ctx.generation))
        return condition_events(before, [c for c in status.conditions if c.type == POOL_CONDITION],
                                {"NotOwned", "CRDNotInstalled"})
