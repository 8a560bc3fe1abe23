"""InferenceService scale to zero: the activator's objects and the Service's routing (pure).

An InferenceService autoscaled by Loom (engine builtin) with minReplicas 0 gets, owned by it (a proxy, proxy.py):

    ServiceAccount  <name>-activator
    Role            <name>-activator   get this InferenceService, patch its scale; list/watch pods (least privilege)
    RoleBinding     <name>-activator
    Deployment      <name>-activator   1 replica of `python -m loom.workloads.activator` (the server image)

and its Service `<name>` selects the activator's pod while the service has no Ready replica (at zero, or waking),
the model servers' pods otherwise (`routes_to_activator`). Why proxy mode and not always in the path: see
loom.workloads.activator. Engines keda and hpa get no activator: KEDA scales to zero by its own activation
threshold and would take a woken service straight back, and an HPA never goes below one replica.
"""

from __future__ import annotations

from loom.workloads.activator.config import DEFAULT_MAX_HELD, DEFAULT_TIMEOUT_SECONDS, ENV_VAR, ActivatorConfig

from ....core.kit import Manifest, match_labels
from ..api import InferenceServiceSpec
from ..render import SERVER_PORT, render_service, server_selector
from .proxy import ADMIN_PORT, proxy_name, render_proxy

COMPONENT = "activator"


def activator_enabled(spec: InferenceServiceSpec) -> bool:
    """Whether this service scales to zero through Loom's activator (engine builtin, minReplicas 0)."""
    autoscaling = spec.autoscaling
    return autoscaling is not None and autoscaling.engine == "builtin" and autoscaling.min_replicas == 0


def activator_name(name: str) -> str:
    return proxy_name(name, COMPONENT)


def activator_selector(owner: Manifest) -> dict[str, str]:
    return match_labels(owner, COMPONENT)


def routes_to_activator(enabled: bool, wanted_replicas: int, ready_replicas: int) -> bool:
    """The Service goes to the activator while the service asks for no replica or none is Ready yet."""
    return enabled and (wanted_replicas == 0 or ready_replicas == 0)


def render_routed_service(owner: Manifest, to_activator: bool) -> Manifest:
    """The service's Service (render.render_service), selecting the activator's
    pod instead of the model servers' while `to_activator`. Both listen on the container port named http."""
    service = render_service(owner)
    if to_activator:
        service["spec"]["selector"] = activator_selector(owner)
    return service


def activator_config(
    owner: Manifest,
    *,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    max_held: int = DEFAULT_MAX_HELD,
) -> ActivatorConfig:
    meta = owner["metadata"]
    group_version = owner.get("apiVersion", "loom.dev/v1alpha1")
    return ActivatorConfig(
        namespace=meta["namespace"],
        service=meta["name"],
        api_version=group_version,
        pod_selector=server_selector(owner),
        target_port=SERVER_PORT,
        port=SERVER_PORT,
        admin_port=ADMIN_PORT,
        timeout_seconds=timeout_seconds,
        max_held=max_held,
    )


def activator_rules(owner: Manifest) -> list[Manifest]:
    """Least privilege: this one InferenceService, read it and write its replicas through scale (render_proxy adds
    the namespace's pods, list/watch)."""
    name = owner["metadata"]["name"]
    group = owner.get("apiVersion", "loom.dev/v1alpha1").split("/")[0]
    return [
        {"apiGroups": [group], "resources": ["inferenceservices"], "resourceNames": [name], "verbs": ["get"]},
        {"apiGroups": [group], "resources": ["inferenceservices/scale"], "resourceNames": [name], "verbs": ["patch"]},
    ]


def render_activator(owner: Manifest, image: str, config: ActivatorConfig) -> list[Manifest]:
    """ServiceAccount, Role, RoleBinding and Deployment of the service's activator, in the order to apply them."""
    return render_proxy(
        owner,
        COMPONENT,
        image=image,
        module="loom.workloads.activator",
        config_env=ENV_VAR,
        config=config,
        rules=activator_rules(owner),
        # Small: held bodies are capped (maxHeldBytes); CPU goes to relaying bytes.
        resources={"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        # Held requests are answered (forwarded or 503) within the bound; let them finish.
        request_seconds=int(config.timeout_seconds),
    )
