"""The endpoint picker's objects for a vllm InferenceService with several replicas (pure: no I/O).

Owned by the InferenceService `<name>` when `picker_policy` is not None:

    ServiceAccount  <name>-picker
    Role            <name>-picker      list/watch pods (the replicas; least privilege, filtered by label)
    RoleBinding     <name>-picker
    Deployment      <name>-picker      1 replica of `python -m loom.workloads.picker` (the server image)

The Service `<name>` selects the picker's pod once it is Ready (`service_selector`), the replicas' pods before
(so a new picker never leaves the service without endpoints), and the activator's pod at zero, as before: the
activator holds and wakes, then the picker routes. The picker's pod has component `picker`, so it is in no
server selector: not counted as a replica, not autoscaled, not in a canary's share.
"""

from __future__ import annotations

from loom.workloads.picker.config import PickerConfig, Policy

from ....core.kit import Manifest, child_metadata, labels, restricted_security_context
from ..api import InferenceServiceSpec
from ..render import DRAIN_SECONDS, KIND_LABEL, REQUEST_GRACE_SECONDS, SERVER_PORT, TRACK_LABEL, server_selector

COMPONENT = "picker"
ADMIN_PORT = 9090
RBAC_API = "rbac.authorization.k8s.io/v1"
CONFIG_ENV = "LOOM_PICKER_CONFIG"
OBJECTS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"), (RBAC_API, "RoleBinding"), (RBAC_API, "Role"), ("v1", "ServiceAccount"),
)


def picker_policy(spec: InferenceServiceSpec) -> Policy | None:
    """The routing policy, or None for no picker: spec.routing's, else prefix-cache for a vllm service that may
    run more than one replica."""
    if spec.runtime != "vllm":
        return None
    if spec.routing is not None:
        return spec.routing.policy
    most = spec.autoscaling.max_replicas if spec.autoscaling is not None else (spec.replicas or 1)
    return "prefix-cache" if most > 1 else None


def picker_name(name: str) -> str:
    return f"{name}-picker"


def picker_selector(owner: Manifest) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": KIND_LABEL,
        "app.kubernetes.io/instance": owner["metadata"]["name"],
        "app.kubernetes.io/component": COMPONENT,
    }


def service_selector(owner: Manifest, to_activator: bool, picker_ready: bool) -> dict[str, str] | None:
    """The Service's selector when the picker decides it (None: leave the activator's routing as it is)."""
    if to_activator or not picker_ready:
        return None
    return picker_selector(owner)


def picker_config(owner: Manifest, spec: InferenceServiceSpec, policy: Policy) -> PickerConfig:
    meta = owner["metadata"]
    routing = spec.routing
    return PickerConfig(
        namespace=meta["namespace"], service=meta["name"], pod_selector=server_selector(owner),
        track_label=TRACK_LABEL, target_port=SERVER_PORT, port=SERVER_PORT, admin_port=ADMIN_PORT, policy=policy,
        session_header=routing.session_affinity.header if routing and routing.session_affinity else None,
        # With adapters, a request for one goes where it is loaded; the engine holds vllm.maxLoadedAdapters.
        base_model=(spec.model.name or meta["name"]) if spec.adapters is not None else None,
        adapter_slots=(spec.vllm.max_loaded_adapters if spec.vllm else None) or 1,
        **({"max_waiting_requests": routing.max_waiting_requests, "max_kv_cache_usage": routing.max_kv_cache_usage}
           if routing else {}),
    )


def render_role(owner: Manifest) -> Manifest:
    return {
        "apiVersion": RBAC_API, "kind": "Role",
        "metadata": child_metadata(owner, picker_name(owner["metadata"]["name"]), COMPONENT),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}],
    }


def render_picker(owner: Manifest, image: str, config: PickerConfig) -> list[Manifest]:
    """ServiceAccount, Role, RoleBinding and Deployment of the service's picker, in the order to apply them."""
    child = picker_name(owner["metadata"]["name"])
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_metadata(owner, child, COMPONENT)}
    binding = {
        "apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": child_metadata(owner, child, COMPONENT),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": child},
        "subjects": [{"kind": "ServiceAccount", "name": child, "namespace": owner["metadata"]["namespace"]}],
    }
    probe = {"httpGet": {"path": "/healthz", "port": "admin"}, "periodSeconds": 2, "timeoutSeconds": 2}
    container: Manifest = {
        "name": COMPONENT,
        "image": image,
        "command": ["python", "-m", "loom.workloads.picker"],
        "env": [{"name": CONFIG_ENV, "value": config.to_json()}],
        "ports": [
            {"name": "http", "containerPort": config.port, "protocol": "TCP"},
            {"name": "admin", "containerPort": config.admin_port, "protocol": "TCP"},
        ],
        "readinessProbe": {**probe, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        # A picker being replaced keeps routing while the Service's endpoint change reaches every proxy.
        "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}},
        # Small: it relays bytes and keeps block hashes (8 bytes and a dict slot each, per replica's capacity).
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": restricted_security_context(),
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": child_metadata(owner, child, COMPONENT),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": picker_selector(owner)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels(owner, COMPONENT),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.admin_port),
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": {
                    "serviceAccountName": child,
                    "automountServiceAccountToken": True,  # it watches the replicas' pods
                    "enableServiceLinks": False,
                    "containers": [container],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    # Requests in flight finish when the picker is replaced, as on a replica being removed.
                    "terminationGracePeriodSeconds": DRAIN_SECONDS + REQUEST_GRACE_SECONDS + 5,
                },
            },
        },
    }
    return [account, render_role(owner), binding, deployment]
