"""Prefill/decode disaggregation: a track as a prefill pool and a decode pool (pure: no I/O).

spec.vllm.disaggregation turns the track's rendered Deployment (every feature's render hook applied) into two
Deployments, `<deployment>-prefill` and `<deployment>-decode`, each with its pool's replicas. Their pods are the
rendered pod with:
- the label `loom.dev/role` (prefill | decode), also in each Deployment's selector (the two never adopt each other's
  pods), and `loom.dev/kv-version`: a short hash of what gives a KV cache its meaning (the model reference, the
  image, the engine's options but those that only size or schedule it);
- the KV connector on the engine, through the front's `--engine-arg`: vLLM's ExampleConnector (the SharedStorage
  connector) with kv_role kv_both on both pools (it stores a prompt's block-aligned KV cache when its folder has
  none and loads it when it has: a decode replica given a prompt nobody prefilled computes it itself), and chunked
  prefill off on both: the connector stores what the request's first scheduled step computed, so a prompt chunked
  over several steps (vLLM's scheduler does under load) would be stored in part, and a decode loading it would fail
  on the shapes or, worse, read slots never computed. Off, vLLM prefills a prompt in one step (it raises
  --max-num-batched-tokens to the model's length itself);
- the user's ReadWriteMany PersistentVolumeClaim (kvStorage.claimName) mounted at the same path in both pools; the
  connector's folder is `<mount>/<kv-version>`, so KV caches of different versions never meet even on one volume
  (the connector names a cache by the prompt's tokens alone).

The Service routes to the service's picker alone (traffic/picker.py): it sends each request to a prefill replica,
then to a decode replica carrying the same kv-version (loom.workloads.picker, PickerConfig.disaggregation).

Rollouts: a new model (or image, or engine option that changes what a KV cache means) is a new kv-version in both
pools' templates, and both Deployments roll as Deployments do. While they roll, old and new pods of each pool run
side by side; the picker pairs a prefill and a decode replica only when their kv-version labels are equal, so no
request meets a prefill of one version and a decode of another (and were it paired wrongly, the decode would find
no cache in its version's folder and compute the prompt itself). When no pair of one version is ready (prefill
rolled before decode), a decode replica answers alone.

What reads the track reads it through `track_view`: both pools in a Deployment's words (replicas and counts summed;
none ready or available unless both pools have a ready replica, so Ready needs both), so rollout planning and
status work unchanged; `pool_status` gives each pool's counts for status.disaggregation.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Literal

from ....core.kit import Condition, Manifest
from ..api import InferenceServiceSpec, ServingPhase
from ..render import CONFIG_HASH_ANNOTATION
from ..source.model import MODEL_ANNOTATION
from ..status import diagnose
from .api import (
    KV_TRANSFER_FLAG,
    NO_CHUNKED_PREFILL_FLAG,
    Disaggregation,
    DisaggregationPoolStatus,
    DisaggregationStatus,
)
from .multinode import FRONT_ENGINE_ARG
from .vllm import engine_options

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
ROLE_LABEL = "loom.dev/role"
KV_VERSION_LABEL = "loom.dev/kv-version"
KV_STORAGE_VOLUME = "kv-storage"
KV_STORAGE_DIR = "/var/cache/loom/kv"
# spec.vllm.disaggregation.connector -> vLLM's connector class (the former SharedStorageConnector).
CONNECTORS = {"SharedStorage": "ExampleConnector"}
# The view of a track run as two pools (not a kind the API server knows: the controller reads it to switch shapes).
VIEW_KIND = "DisaggregatedPools"
# Engine options that size or schedule the engine without changing what a block of KV cache holds.
_CAPACITY_OPTIONS = {"kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs", "enforce_eager"}


def disaggregation(spec: InferenceServiceSpec) -> Disaggregation | None:
    if spec.runtime != "vllm" or spec.vllm is None:
        return None
    return spec.vllm.disaggregation


def disaggregated(spec: InferenceServiceSpec) -> bool:
    return disaggregation(spec) is not None


def pool_name(track_deployment: str, role: Role) -> str:
    return f"{track_deployment}-{role}"


def _server(template: Manifest) -> Manifest:
    server: Manifest = next(c for c in template["spec"]["containers"] if c["name"] == "server")
    return server


def kv_version(spec: InferenceServiceSpec, deployment: Manifest) -> str:
    """16 hex characters naming what gives a KV cache its meaning: the model reference the track runs (its
    annotation: uri, version, digest), the server image, and the engine's options but those that only size or
    schedule it. A prefill and a decode replica are paired only with equal versions."""
    model = (deployment["metadata"].get("annotations") or {}).get(MODEL_ANNOTATION)
    engine = engine_options(spec).model_dump(exclude=_CAPACITY_OPTIONS)
    image = _server(deployment["spec"]["template"]).get("image")
    key = json.dumps({"model": model, "image": image, "engine": engine}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def kv_transfer_config(split: Disaggregation, version: str) -> str:
    """vLLM's --kv-transfer-config for both pools (one JSON: the same connector stores and loads)."""
    return json.dumps({
        "kv_connector": CONNECTORS[split.connector], "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": f"{KV_STORAGE_DIR}/{version}"},
    }, separators=(",", ":"))  # fmt: skip


def pool_deployment(deployment: Manifest, spec: InferenceServiceSpec, role: Role) -> Manifest:
    """One pool of the track: the rendered Deployment with its role, kv-version, connector and shared volume."""
    split = disaggregation(spec)
    assert split is not None
    version = kv_version(spec, deployment)
    pool = copy.deepcopy(deployment)
    meta, pool_spec = pool["metadata"], pool["spec"]
    meta["name"] = pool_name(meta["name"], role)
    meta["labels"] = {**(meta.get("labels") or {}), ROLE_LABEL: role}
    # Scaled to zero, the track runs no pool; otherwise each pool its own replicas.
    pool_spec["replicas"] = getattr(split, role).replicas if int(pool_spec.get("replicas", 1)) > 0 else 0
    pool_spec["selector"]["matchLabels"] = {**pool_spec["selector"]["matchLabels"], ROLE_LABEL: role}
    template = pool_spec["template"]
    template["metadata"]["labels"] = {**template["metadata"]["labels"], ROLE_LABEL: role, KV_VERSION_LABEL: version}
    # One hash for both pools' pods, which status reads as the serving template's: the track's, and the connector's.
    annotations = template["metadata"]["annotations"]
    connector = kv_transfer_config(split, version) + split.kv_storage.claim_name
    annotations[CONFIG_HASH_ANNOTATION] = hashlib.sha256(
        (annotations.get(CONFIG_HASH_ANNOTATION, "") + connector).encode()
    ).hexdigest()[:16]
    template["spec"]["volumes"] = [
        *template["spec"].get("volumes", []),
        {"name": KV_STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": split.kv_storage.claim_name}},
    ]
    server = _server(template)
    server["volumeMounts"] = [*server.get("volumeMounts", []), {"name": KV_STORAGE_VOLUME, "mountPath": KV_STORAGE_DIR}]
    command: list[str] = server["command"]
    at = command.index("--drain-seconds") if "--drain-seconds" in command else len(command)
    engine_args = [
        f"{FRONT_ENGINE_ARG}={KV_TRANSFER_FLAG}={kv_transfer_config(split, version)}",
        f"{FRONT_ENGINE_ARG}={NO_CHUNKED_PREFILL_FLAG}",
    ]
    server["command"] = [*command[:at], *engine_args, *command[at:]]
    return pool


def pools(deployment: Manifest, spec: InferenceServiceSpec) -> list[Manifest]:
    """The track's prefill and decode Deployments, in that order."""
    return [pool_deployment(deployment, spec, role) for role in ROLES]


def _current(deployment: Manifest) -> bool:
    status = deployment.get("status") or {}
    return int(status.get("observedGeneration", 0)) >= int(deployment.get("metadata", {}).get("generation", 0))


def track_view(track_deployment: str, found: dict[Role, Manifest | None]) -> Manifest | None:
    """The pools (as found or applied; None when neither exists) as the rollout, status and autoscaling code reads
    a Deployment: replicas and counts summed, nothing ready or available unless both pools have a ready replica, the
    view's generation observed only when both pools' are, a pool missing counted as not rolled out. Each pool's own
    counts are kept under status.pools (pool_status)."""
    present = {role: d for role, d in found.items() if d is not None}
    if not present:
        return None
    first = next(iter(present.values()))

    def total(field: str) -> int:
        return sum(int((d.get("status") or {}).get(field, 0)) for d in present.values())

    ready = {role: int(((present.get(role) or {}).get("status") or {}).get("readyReplicas", 0)) for role in ROLES}
    both = all(ready.values())
    stuck = [
        c for d in present.values() for c in (d.get("status") or {}).get("conditions") or []
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
    ]  # fmt: skip
    observed = 1 if len(present) == len(ROLES) and all(_current(d) for d in present.values()) else 0
    metadata = copy.deepcopy(first["metadata"])
    metadata["name"] = track_deployment
    metadata["generation"] = 1
    return {
        "apiVersion": "apps/v1",
        "kind": VIEW_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": sum(int(d["spec"].get("replicas", 0)) for d in present.values()),
            "template": first["spec"]["template"],
        },
        "status": {
            "observedGeneration": observed,
            "replicas": total("replicas"),
            "readyReplicas": total("readyReplicas") if both else 0,
            "availableReplicas": total("availableReplicas") if both else 0,
            "updatedReplicas": total("updatedReplicas"),
            "conditions": stuck[:1],
            "pools": {
                role: {
                    "replicas": int(((present.get(role) or {}).get("spec") or {}).get("replicas", 0)),
                    "readyReplicas": ready[role],
                    "updatedReplicas": int(((present.get(role) or {}).get("status") or {}).get("updatedReplicas", 0)),
                }
                for role in ROLES
            },
        },
    }


def pool_status(view: Manifest | None) -> DisaggregationStatus | None:
    """Each pool's counts from a track's view (None: the track does not run as pools)."""
    if view is None or view.get("kind") != VIEW_KIND:
        return None
    pools_seen: dict[str, Any] = view["status"]["pools"]
    labels = (view["spec"]["template"].get("metadata") or {}).get("labels") or {}
    return DisaggregationStatus(
        prefill=DisaggregationPoolStatus.model_validate(pools_seen["prefill"]),
        decode=DisaggregationPoolStatus.model_validate(pools_seen["decode"]),
        kv_version=labels.get(KV_VERSION_LABEL),
    )


def ready_message(status: DisaggregationStatus) -> str:
    """The pools' readiness in the Ready condition's words."""
    p, d = status.prefill, status.decode
    return f"prefill {p.ready_replicas}/{p.replicas} ready, decode {d.ready_replicas}/{d.replicas} ready"


def with_pools_in_ready(
    conditions: list[Condition], status: DisaggregationStatus, pods: list[Manifest] | None = None
) -> list[Condition]:
    """The Ready condition with each pool's readiness after its message (Ready needs a ready replica in both). When
    one pool has ready replicas and the other none, Ready is False for the other's reason, diagnosed from its own
    pods (`pods`: the service's; what counted replicas loaded for ModelLoaded hides it otherwise)."""
    pools = ready_message(status)
    waiting = [role for role in ROLES if getattr(status, role).ready_replicas == 0]
    out = []
    for c in conditions:
        if c.type == "Ready" and c.status == "False" and len(waiting) == 1 and pods is not None:
            role = waiting[0]
            own = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL) == role]
            reason, message = diagnose(own)
            c = c.model_copy(update={"reason": reason, "message": f"no ready replica in the {role} pool: {message}"})
        if c.type == "Ready":
            c = c.model_copy(update={"message": f"{c.message}; {pools}" if c.message else pools})
        out.append(c)
    return out


def phase_with_pools(phase: ServingPhase | None, conditions: list[Condition]) -> ServingPhase | None:
    """Loading becomes Failed when Ready names a pool whose pods cannot fetch or load the model (as a service with
    no replica ready is Failed for its pods' failure)."""
    ready = next((c for c in conditions if c.type == "Ready"), None)
    failed = ready is not None and ready.status == "False" and ready.reason in ("FetchFailed", "LoadFailed")
    return "Failed" if phase == "Loading" and failed else phase
