"""The endpoint picker's objects for a vllm InferenceService with several replicas (pure: no I/O).

Owned by the InferenceService `<name>` when `picker_policy` is not None (a proxy, proxy.py):

    ServiceAccount  <name>-picker
    Role            <name>-picker      list/watch pods (the replicas; least privilege, filtered by label)
    RoleBinding     <name>-picker
    Lease           <name>-picker      with routing.pickerReplicas > 1: which picker pod serves (the pods elect)
    Deployment      <name>-picker      routing.pickerReplicas of `python -m loom.workloads.picker` (the server image)

The Service `<name>` selects the picker's pod once it is Ready (`service_selector`), the replicas' pods before
(so a new picker never leaves the service without endpoints; a disaggregated service's only through the picker, whose
two calls its replicas need), and the activator's pod at zero, as before: the
activator holds and wakes, then the picker routes. The picker's pod has component `picker`, so it is in no
server selector: not counted as a replica, not autoscaled, not in a canary's share.
"""

from __future__ import annotations

from loom.workloads.picker.config import (
    ENV_VAR,
    DisaggregationConfig,
    FlowControlConfig,
    KvEventsConfig,
    LeaderElectionConfig,
    PickerConfig,
    Policy,
)

from ....core.kit import Manifest, child_metadata, match_labels
from ..api import InferenceServiceSpec
from ..llm.disaggregation import KV_VERSION_LABEL, ROLE_LABEL, disaggregated
from ..llm.vllm import kv_events_port
from ..render import DRAIN_SECONDS, REQUEST_GRACE_SECONDS, SERVER_PORT, TRACK_LABEL, server_selector
from .proxy import ADMIN_PORT, proxy_name, render_proxy

# Where the picker answers a gateway's Envoy over gRPC (ext_proc and health): GIE's reference picker's port, which
# gateways' examples assume. The Service <name>-picker (pool.py) exposes it.
EXT_PROC_PORT = 9002

COMPONENT = "picker"


def picker_policy(spec: InferenceServiceSpec) -> Policy | None:
    """The routing policy, or None for no picker: spec.routing's, else prefix-cache for a vllm service that may
    run more than one replica or is disaggregated (the picker sends each request to a prefill and a decode pod)."""
    if spec.runtime != "vllm":
        return None
    if spec.routing is not None:
        return spec.routing.policy
    if disaggregated(spec):
        return "prefix-cache"
    most = spec.autoscaling.max_replicas if spec.autoscaling is not None else (spec.replicas or 1)
    return "prefix-cache" if most > 1 else None


def picker_name(name: str) -> str:
    return proxy_name(name, COMPONENT)


def picker_selector(owner: Manifest) -> dict[str, str]:
    return match_labels(owner, COMPONENT)


def service_selector(
    owner: Manifest, to_activator: bool, picker_ready: bool, picker_only: bool = False
) -> dict[str, str] | None:
    """The Service's selector when the picker decides it (None: leave the activator's routing as it is).
    `picker_only`: the picker even before it is ready (a disaggregated service's pods serve only through it)."""
    if to_activator or not (picker_ready or picker_only):
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
        # Only when set: a config rendered without it stays byte for byte the same (no picker rollout at upgrade).
        **({"flow_control": FlowControlConfig.model_validate(routing.flow_control.model_dump())}
           if routing and routing.flow_control else {}),
        # A gateway's Envoy asks it over ext_proc (pool.py renders the InferencePool and the Service to this port).
        ext_proc_port=EXT_PROC_PORT if routing and routing.inference_pool else None,
        # Precise prefix routing: the engines publish their KV events there (llm/vllm.py renders the flag); the
        # tokenizer is read from a replica's front (no tokenizerDir: the picker pod has no model files).
        **({"kv_events": KvEventsConfig(port=events)} if (events := kv_events_port(spec)) is not None else {}),
        # Several pods: the one holding the Lease serves (workloads/picker/election.py); only when set, as above.
        **({"leader_election": LeaderElectionConfig(lease_name=picker_name(meta["name"]))}
           if picker_replicas(spec) > 1 else {}),
        # Only when set, as flow control: each request to a prefill pod, then a decode pod of the same kv-version.
        **({"disaggregation": DisaggregationConfig(role_label=ROLE_LABEL, version_label=KV_VERSION_LABEL)}
           if disaggregated(spec) else {}),
    )


def picker_replicas(spec: InferenceServiceSpec) -> int:
    return spec.routing.picker_replicas if spec.routing is not None else 1


LEASE_API = "coordination.k8s.io/v1"
# With standbys, a rollout replaces every picker pod at once, the new ones started beside the old (surge) so they
# are up when the old leader leaves. Why not the one-pod strategy (maxSurge 1, maxUnavailable 0): only the leader is
# ever Ready, so a Deployment's pods are never more than one available; a new pod stands by (the old leader holds
# the Lease) and never becomes available, the Deployment waits for it before removing an old pod, and the old
# leader never goes: the rollout is stuck for good. Any maxUnavailable below the replica count waits the same way
# (it keeps replicas - maxUnavailable >= 1 pods available, and the old leader is the only one). With 100% the old
# pods are told to stop at once; the leader keeps serving through its preStop drain (a terminating endpoint still
# serves), frees the Lease at SIGTERM, and a new pod, started meanwhile, takes it within its retry period (2 s) and
# is Ready at its next probe (2 s). The price: the Deployment never counts all its pods available, so it never
# reports a rollout complete (`kubectl rollout status` waits; Progressing turns False after its deadline); Loom
# reads only its readyReplicas (io.py: the Service goes to the picker while one is Ready, else to the replicas).
STANDBY_STRATEGY: Manifest = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": "100%"}}


def render_lease(owner: Manifest) -> Manifest:
    """The Lease the picker pods elect their leader with, created (empty) by the operator, so the pods need no
    `create` (which RBAC cannot narrow to one name); owned by the service, deleted with it."""
    return {"apiVersion": LEASE_API, "kind": "Lease",
            "metadata": child_metadata(owner, picker_name(owner["metadata"]["name"]), COMPONENT)}


def render_picker(owner: Manifest, image: str, config: PickerConfig, replicas: int = 1) -> list[Manifest]:
    """ServiceAccount, Role, RoleBinding, (the Lease, with several replicas) and Deployment of the service's picker,
    in the order to apply them."""
    election = config.leader_election
    manifests = render_proxy(
        owner,
        COMPONENT,
        image=image,
        module="loom.workloads.picker",
        config_env=ENV_VAR,
        config=config,
        # The replicas' pods (render_proxy's list/watch); with standbys, its own Lease: read and renewed, by name.
        rules=[{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [election.lease_name],
                "verbs": ["get", "update"]}] if election is not None else [],
        # Small: it relays bytes and keeps block hashes (8 bytes and a dict slot each, per replica's capacity).
        resources={"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        # Replaced, it keeps routing while the endpoint change propagates, then finishes what is in flight, as a
        # replica being removed does.
        request_seconds=REQUEST_GRACE_SECONDS,
        drain_seconds=DRAIN_SECONDS,
        extra_ports=[{"name": "grpc", "containerPort": config.ext_proc_port, "protocol": "TCP"}]
        if config.ext_proc_port else [],
        replicas=replicas,
        # Ready only while it serves (the leader, or the only pod); live while it answers.
        readiness_path="/readyz" if election is not None else "/healthz",  # one pod: its template as before
        strategy=STANDBY_STRATEGY if election is not None else None,
        # The pod's name is its identity in the Lease.
        extra_env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
        if election is not None else [],
    )
    if election is not None:
        manifests.insert(-1, render_lease(owner))  # before the Deployment: its pods find it
    return manifests
