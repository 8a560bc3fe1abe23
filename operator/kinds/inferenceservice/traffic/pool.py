"""The Gateway API Inference Extension's objects for a routed vllm InferenceService (pure: no I/O).

With spec.routing.inferencePool, besides the picker (picker.py), owned by the InferenceService `<name>`:

    Service        <name>-picker   the picker's pod, port grpc (EXT_PROC_PORT, h2c): Envoy's ext_proc and
                                   grpc.health.v1 (loom.workloads.picker.extproc)
    InferencePool  <name>          inference.networking.k8s.io/v1: the replicas' pods (both tracks: the picker
                                   keeps the canary's share), their front's port, the picker's Service above as
                                   endpointPickerRef with the failure mode asked

A user's HTTPRoute points at the pool (backendRefs: group inference.networking.k8s.io, kind InferencePool); a
GIE gateway asks the picker which replica takes each request. An InferencePool `<name>` that this service does not
own (a user's, made before) is never written: `ownership` tells, and the InferencePool condition says so.
"""

from __future__ import annotations

from typing import Literal

from ....core.kit import Manifest, child_metadata
from ..render import SERVER_PORT, server_selector
from .picker import COMPONENT, EXT_PROC_PORT, picker_name, picker_selector

GROUP = "inference.networking.k8s.io"
API_VERSION = f"{GROUP}/v1"
KIND = "InferencePool"
CONDITION = "InferencePool"

# "absent", "ours", "theirs": whose pool stands under the name; "no_crd": the cluster serves no InferencePool kind.
Ownership = Literal["absent", "ours", "theirs", "no_crd"]


def pool_name(name: str) -> str:
    return name


def render_picker_service(owner: Manifest) -> Manifest:
    """The Service a gateway's Envoy reaches the picker through (endpointPickerRef). HTTP/2 cleartext: gRPC."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, picker_name(owner["metadata"]["name"]), COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(owner),
            "ports": [{"name": "grpc", "port": EXT_PROC_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "kubernetes.io/h2c"}],
        },
    }


def render_inference_pool(owner: Manifest, failure_mode: str) -> Manifest:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": child_metadata(owner, pool_name(name), COMPONENT),
        "spec": {
            "selector": {"matchLabels": server_selector(owner)},
            "targetPorts": [{"number": SERVER_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker_name(name),
                "port": {"number": EXT_PROC_PORT},
                "failureMode": failure_mode,
            },
        },
    }


def ownership(existing: Manifest | None, owner: Manifest) -> Ownership:
    """Whether the InferencePool found under the pool's name is absent, this service's (its controller owner
    reference carries the service's uid), or someone else's."""
    if existing is None:
        return "absent"
    uid = owner["metadata"].get("uid")
    for ref in existing.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("uid") == uid:
            return "ours"
    return "theirs"


def pool_condition(name: str, state: Ownership) -> tuple[bool, str, str]:
    """(ok, reason, message) of the InferencePool condition after this pass's apply (or refusal to)."""
    if state == "no_crd":
        return (False, "CRDNotInstalled", f"no InferencePool {name}: the cluster does not serve "
                f"{API_VERSION} InferencePool (install the Gateway API Inference Extension's CRDs)")
    if state == "theirs":
        return (False, "NotOwned", f"InferencePool {name} exists and was not made by this InferenceService: left as "
                "it is (delete it, or name the service differently, for Loom to manage one)")
    return (True, "Applied", f"InferencePool {name} selects the replicas; its endpoint picker is Service "
            f"{picker_name(name)} port {EXT_PROC_PORT}")
