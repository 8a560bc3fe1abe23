"""InferenceService scale to zero: the activator's objects and the Service's routing (pure).

An InferenceService autoscaled by Loom (engine builtin) with minReplicas 0 gets, owned by it:

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

from loom.workloads.activator.config import DEFAULT_MAX_HELD, DEFAULT_TIMEOUT_SECONDS, ActivatorConfig

from ....core.kit import Manifest, child_metadata, labels, restricted_security_context
from ..api import InferenceServiceSpec
from ..render import KIND_LABEL, SERVER_PORT, render_service, server_selector

COMPONENT = "activator"
ADMIN_PORT = 9090
RBAC_API = "rbac.authorization.k8s.io/v1"
CONFIG_ENV = "LOOM_ACTIVATOR_CONFIG"
# What the operator deletes when a service stops scaling to zero (Deployment first: it is what runs).
OBJECTS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    (RBAC_API, "RoleBinding"),
    (RBAC_API, "Role"),
    ("v1", "ServiceAccount"),
)


def activator_enabled(spec: InferenceServiceSpec) -> bool:
    """Whether this service scales to zero through Loom's activator (engine builtin, minReplicas 0)."""
    autoscaling = spec.autoscaling
    return autoscaling is not None and autoscaling.engine == "builtin" and autoscaling.min_replicas == 0


def activator_name(name: str) -> str:
    return f"{name}-activator"


def activator_selector(owner: Manifest) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": KIND_LABEL,
        "app.kubernetes.io/instance": owner["metadata"]["name"],
        "app.kubernetes.io/component": COMPONENT,
    }


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


def render_role(owner: Manifest) -> Manifest:
    """Least privilege: this one InferenceService (read it, write its replicas through scale) and the
    namespace's pods (list/watch cannot be narrowed by name; the activator filters by label)."""
    name = owner["metadata"]["name"]
    group = owner.get("apiVersion", "loom.dev/v1alpha1").split("/")[0]
    return {
        "apiVersion": RBAC_API,
        "kind": "Role",
        "metadata": child_metadata(owner, activator_name(name), COMPONENT),
        "rules": [
            {"apiGroups": [group], "resources": ["inferenceservices"], "resourceNames": [name], "verbs": ["get"]},
            {
                "apiGroups": [group],
                "resources": ["inferenceservices/scale"],
                "resourceNames": [name],
                "verbs": ["patch"],
            },
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        ],
    }


def render_activator(owner: Manifest, image: str, config: ActivatorConfig) -> list[Manifest]:
    """ServiceAccount, Role, RoleBinding and Deployment of the service's activator, in the order to apply them."""
    name = owner["metadata"]["name"]
    child = activator_name(name)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_metadata(owner, child, COMPONENT)}
    binding = {
        "apiVersion": RBAC_API,
        "kind": "RoleBinding",
        "metadata": child_metadata(owner, child, COMPONENT),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": child},
        "subjects": [{"kind": "ServiceAccount", "name": child, "namespace": owner["metadata"]["namespace"]}],
    }
    probe = {"httpGet": {"path": "/healthz", "port": "admin"}, "periodSeconds": 2, "timeoutSeconds": 2}
    container: Manifest = {
        "name": COMPONENT,
        "image": image,
        "command": ["python", "-m", "loom.workloads.activator"],
        "env": [{"name": CONFIG_ENV, "value": config.to_json()}],
        "ports": [
            {"name": "http", "containerPort": config.port, "protocol": "TCP"},
            {"name": "admin", "containerPort": config.admin_port, "protocol": "TCP"},
        ],
        "readinessProbe": {**probe, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        # Small: held bodies are capped (maxHeldBytes); CPU goes to relaying bytes.
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": restricted_security_context(),
    }
    pod_labels = labels(owner, COMPONENT)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, child, COMPONENT),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": activator_selector(owner)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(config.admin_port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": child,
                    "automountServiceAccountToken": True,  # it reads pods and wakes the service
                    "enableServiceLinks": False,
                    "containers": [container],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    # Held requests are answered (forwarded or 503) within the bound; let them finish.
                    "terminationGracePeriodSeconds": int(config.timeout_seconds) + 5,
                },
            },
        },
    }
    return [account, render_role(owner), binding, deployment]
