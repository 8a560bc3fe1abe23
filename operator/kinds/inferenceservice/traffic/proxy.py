"""The one pod Loom runs in front of an InferenceService's replicas: the scale-to-zero activator (activator.py) and
the endpoint picker (picker.py) are each such a proxy, rendered here with their differences as parameters (pure).

Owned by the InferenceService `<name>`, in the order to apply them:

    ServiceAccount  <name>-<component>
    Role            <name>-<component>   the caller's rules, then list/watch pods (least privilege)
    RoleBinding     <name>-<component>
    Deployment      <name>-<component>   `python -m <module>` (the server image), 1 replica unless told

The pod takes the Service's requests on the port named http (the one the model servers' pods name http, so the
Service only changes its selector), answers /healthz and /metrics on the port named admin, and reads its whole
configuration (a WorkloadConfig, the contract with the workload) as JSON from one environment variable.
"""

from __future__ import annotations

from typing import Protocol

from ....core.kit import Manifest, child_metadata, labels, match_labels, restricted_security_context

RBAC_API = "rbac.authorization.k8s.io/v1"
# Where the proxies' /healthz and /metrics listen (their configs' adminPort).
ADMIN_PORT = 9090
# What the operator deletes when a service stops needing its proxy (Deployment first: it is what runs).
OBJECTS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    (RBAC_API, "RoleBinding"),
    (RBAC_API, "Role"),
    ("v1", "ServiceAccount"),
)
# Seconds a terminating proxy gets beyond its drain and its longest request, to stop and exit.
EXIT_SECONDS = 5


class ProxyConfig(Protocol):
    """What the Deployment reads from a proxy's config: its ports and its wire form. ActivatorConfig and PickerConfig
    are WorkloadConfigs, whose one `to_json` writes the text the pod parses back; the ports are theirs, not the
    base's (other workloads' configs have none), hence a protocol and not WorkloadConfig."""

    @property
    def port(self) -> int: ...

    @property
    def admin_port(self) -> int: ...

    def to_json(self) -> str: ...


def proxy_name(name: str, component: str) -> str:
    return f"{name}-{component}"


def render_proxy(
    owner: Manifest,
    component: str,
    *,
    image: str,
    module: str,
    config_env: str,
    config: ProxyConfig,
    rules: list[Manifest],
    resources: Manifest,
    request_seconds: int,
    drain_seconds: int = 0,
    extra_ports: list[Manifest] | None = None,
    replicas: int = 1,
    readiness_path: str = "/healthz",
    strategy: Manifest | None = None,
    extra_env: list[Manifest] | None = None,
) -> list[Manifest]:
    """ServiceAccount, Role, RoleBinding and Deployment of the service's `component` proxy, in the order to apply
    them. `rules`: what it may do besides watching pods (every proxy finds the replicas by their pods' labels).
    `request_seconds`: the longest a request it holds or relays takes to finish once it is told to stop;
    `drain_seconds`: a preStop sleep (0: none) while the Service's endpoint change reaches every proxy in front;
    `extra_ports`: container ports beside http and admin (the picker's gRPC); `replicas`, `readiness_path`,
    `strategy` and `extra_env`: a proxy whose pods elect one to serve (the picker's standby) differs there: its
    readiness is not its liveness, and a rollout cannot wait for a standby to be Ready."""
    child = proxy_name(owner["metadata"]["name"], component)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_metadata(owner, child, component)}
    role = {
        "apiVersion": RBAC_API,
        "kind": "Role",
        "metadata": child_metadata(owner, child, component),
        # list/watch cannot be narrowed by name: the proxy filters the namespace's pods by label.
        "rules": [*rules, {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}],
    }
    binding = {
        "apiVersion": RBAC_API,
        "kind": "RoleBinding",
        "metadata": child_metadata(owner, child, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": child},
        "subjects": [{"kind": "ServiceAccount", "name": child, "namespace": owner["metadata"]["namespace"]}],
    }
    probe = {"httpGet": {"path": "/healthz", "port": "admin"}, "periodSeconds": 2, "timeoutSeconds": 2}
    readiness = {**probe, "httpGet": {"path": readiness_path, "port": "admin"}, "failureThreshold": 2}
    container: Manifest = {
        "name": component,
        "image": image,
        "command": ["python", "-m", module],
        "env": [{"name": config_env, "value": config.to_json()}, *(extra_env or [])],
        "ports": [
            {"name": "http", "containerPort": config.port, "protocol": "TCP"},
            {"name": "admin", "containerPort": config.admin_port, "protocol": "TCP"},
            *(extra_ports or []),
        ],
        "readinessProbe": readiness,
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
    }
    if drain_seconds:
        # A proxy being replaced keeps taking requests while its endpoint's removal propagates.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": drain_seconds}}}
    container["resources"] = resources
    container["securityContext"] = restricted_security_context()
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner, child, component),
        "spec": {
            "replicas": replicas,
            # The kit's, as the pod's labels: what they mark it selects; the servers' pods (another component) never.
            "selector": {"matchLabels": match_labels(owner, component)},
            # The new pod is Ready before the old one stops: the Service always has the proxy to route to.
            "strategy": strategy or {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels(owner, component),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(config.admin_port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": child,
                    "automountServiceAccountToken": True,  # it watches the replicas' pods (the rules above)
                    "enableServiceLinks": False,
                    "containers": [container],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    # Requests in flight finish (forwarded, answered or refused) before the pod is killed.
                    "terminationGracePeriodSeconds": drain_seconds + request_seconds + EXIT_SECONDS,
                },
            },
        },
    }
    return [account, role, binding, deployment]
