"""Applying an InferenceService's scale-to-zero routing (the I/O around activator.py).

Called by the reconcile pass in place of applying the Service alone. Order matters for traffic: with the
activator, its objects go first and then the Service (which may select its pod); without it, the Service goes
back to the model servers first and then the activator's objects are deleted.
"""

from __future__ import annotations

from ...core import client as kube
from ...core.kit import Manifest
from ...settings import OperatorSettings
from .activator import (
    OBJECTS,
    activator_config,
    activator_enabled,
    activator_name,
    render_activator,
    render_routed_service,
    routes_to_activator,
)
from .api import InferenceServiceSpec
from .rollout import RolloutPlan


def _ready(deployment: Manifest | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


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
    wanted = plan.stable_replicas + plan.canary_replicas
    to_activator = routes_to_activator(enabled, wanted, _ready(stable) + _ready(canary))
    await kube.apply(render_routed_service(owner, to_activator))
    if not enabled and await kube.get("apps/v1", "Deployment", namespace, activator_name(name)) is not None:
        for api_version, kind in OBJECTS:
            await kube.delete(api_version, kind, namespace, activator_name(name))
    return to_activator
