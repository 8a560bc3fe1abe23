"""A vllm replica larger than one pod: a LeaderWorkerSet group instead of a Deployment pod (pure: no I/O).

spec.vllm.parallelism.podsPerReplica > 1 turns the track's rendered Deployment (every feature's render hook
applied) into a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) named `<deployment>-group`, with its labels and
replicas, where a replica is a group of podsPerReplica pods. Not the Deployment's own name: LWS gives each group a
headless Service of the LeaderWorkerSet's name (the workers reach their leader as <lws>-<group>.<lws>.<namespace>)
and keeps a Service it finds of that name, which for the stable track would be the InferenceService's own ClusterIP
Service: no DNS name for the leader, and the workers could never join.
- the leader is the Deployment's pod as rendered: the fetch step, then Loom's OpenAI front over vLLM's rank-0
  process (the front starts vLLM with `--nnodes`, `--node-rank=0` and `--master-addr` = the group's leader address,
  which LWS's pod webhook puts in the pod's environment and the kubelet expands in the command line); it alone
  carries the server component label, so the Service, the pod index and the autoscaler's metrics see one pod per
  replica;
- each worker fetches the same model and runs vLLM headless (loom.workloads.llm.worker) with node rank = its worker
  index, joining the leader's torch.distributed group; component label `worker`, no port, no probes but the
  process (vLLM exits when it loses its group);
- restartPolicy RecreateGroupOnPodRestart: any member's loss (a worker killed, a container restarted) deletes and
  recreates the whole group, as a distributed engine cannot take a member back;
- rolled out by LWS's rolling update, a group at a time (one group never runs two templates), with the
  Deployment's maxSurge and its maxUnavailable, except 0 becomes 1: LWS passes it to its leader StatefulSet, which
  refuses 0 ("spec.updateStrategy.rollingUpdate.maxUnavailable: cannot be 0"); with a surge, the new group is
  created before an old one goes;
- startupPolicy LeaderCreated: the leader cannot be ready before its workers joined, so they must not wait for it.

What reads the track reads it through `deployment_view`: the LeaderWorkerSet's status in a Deployment's words
(groups for replicas), so rollout planning, status and autoscaling count groups unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

from ....core.kit import Manifest
from ..api import InferenceServiceSpec

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
WORKER_COMPONENT = "worker"
COMPONENT_LABEL = "app.kubernetes.io/component"
# torch.distributed's rendezvous on the leader (vLLM's --master-port default).
MASTER_PORT = 29501
# Set by LWS's pod webhook on every container of a group; $(VAR) is expanded by the kubelet in command lines.
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
WORKER_MODULE = "loom.workloads.llm.worker"
# The flag of the front that appends engine flags rendered per pod (the leader address differs per group).
FRONT_ENGINE_ARG = "--engine-arg"


def group_set_name(track_name: str) -> str:
    """The LeaderWorkerSet of a track (its Deployment's name, deployment_name), and so its pods' subdomain."""
    return f"{track_name}-group"


def pods_per_replica(spec: InferenceServiceSpec) -> int:
    vllm = spec.vllm
    return vllm.parallelism.pods_per_replica if vllm is not None and vllm.parallelism is not None else 1


def grouped(spec: InferenceServiceSpec) -> bool:
    """Whether a replica is a LeaderWorkerSet group (runtime vllm, more than one pod per replica)."""
    return spec.runtime == "vllm" and pods_per_replica(spec) > 1


def parallel_flags(spec: InferenceServiceSpec) -> list[str]:
    """vLLM flags every rank of a replica shares, beyond --tensor-parallel-size (EngineOptions sets it): pipeline
    and data parallel sizes, and with several pods the node count, the rendezvous port and the multiprocessing
    executor (vLLM's multi-node mode without Ray)."""
    vllm = spec.vllm
    if vllm is None or vllm.parallelism is None:
        return []
    par = vllm.parallelism
    flags = []
    if par.pipeline > 1:
        flags.append(f"--pipeline-parallel-size={par.pipeline}")
    if par.data > 1:
        flags.append(f"--data-parallel-size={par.data}")
    if par.pods_per_replica > 1:
        flags += [
            f"--nnodes={par.pods_per_replica}", f"--master-port={MASTER_PORT}", "--distributed-executor-backend=mp",
        ]  # fmt: skip
        if par.data > 1:
            flags.append("--data-parallel-backend=mp")
    return flags


# LWS runs a group's workers as a StatefulSet <lws>-<group index>; a StatefulSet's name is at most 52 characters
# (its pods' controller-revision-hash label, <name>-<10-character hash>, is a 63-character label value).
STATEFULSET_NAME_MAX = 52


def check(spec: InferenceServiceSpec, name: str = "") -> str | None:
    """What the CRD's rules cannot see (they see spec.vllm alone): the GPUs a group holds against its ranks, and
    names LWS derives from the service's that would be too long (the canary's workers', at the most groups)."""
    vllm = spec.vllm
    if vllm is None or vllm.parallelism is None:
        return None
    par = vllm.parallelism
    if spec.runtime != "vllm":
        return "spec.vllm.parallelism needs runtime: vllm"
    most_groups = spec.autoscaling.max_replicas if spec.autoscaling is not None else spec.replicas or 1
    workers = f"{group_set_name(name + '-canary')}-{max(0, most_groups - 1)}"
    if par.pods_per_replica > 1 and len(workers) > STATEFULSET_NAME_MAX:
        return (
            f"the name {name!r} is too long for groups of pods: LWS would name a canary's workers {workers!r}, over "
            f"the {STATEFULSET_NAME_MAX} characters a StatefulSet's name may have"
        )
    if spec.gpus > 0 and spec.gpus * par.pods_per_replica != par.world_size:
        return (
            f"spec.gpus ({spec.gpus}) x parallelism.podsPerReplica ({par.pods_per_replica}) must equal tensor x "
            f"pipeline x data ({par.world_size}): one engine rank per GPU"
        )
    return None


def _server(template: Manifest) -> Manifest:
    server: Manifest = next(c for c in template["spec"]["containers"] if c["name"] == "server")
    return server


def leader_template(template: Manifest) -> Manifest:
    """The rendered pod as the group's leader: the front's command gains the per-group engine flags."""
    leader = copy.deepcopy(template)
    server = _server(leader)
    command: list[str] = server["command"]
    at = command.index("--drain-seconds") if "--drain-seconds" in command else len(command)
    per_pod = [f"{FRONT_ENGINE_ARG}=--node-rank=0", f"{FRONT_ENGINE_ARG}=--master-addr={LEADER_ADDRESS}"]
    server["command"] = [*command[:at], *per_pod, *command[at:]]
    return leader


def worker_template(template: Manifest, config_file: str) -> Manifest:
    """The rendered pod as a worker: the same fetch step and volumes, vLLM headless instead of the front."""
    worker = copy.deepcopy(template)
    worker["metadata"]["labels"][COMPONENT_LABEL] = WORKER_COMPONENT
    annotations = worker["metadata"].get("annotations") or {}
    worker["metadata"]["annotations"] = {k: v for k, v in annotations.items() if not k.startswith("prometheus.io/")}
    server = _server(worker)
    server["command"] = [
        "python", "-m", WORKER_MODULE, "--config", config_file,
        f"--node-rank={WORKER_INDEX}", f"--master-addr={LEADER_ADDRESS}",
    ]  # fmt: skip
    for key in ("ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"):
        server.pop(key, None)
    return worker


def _at_least_one(value: int | str) -> int | str:
    return 1 if str(value).strip().rstrip("%").strip() in ("0", "") else value


def leader_worker_set(deployment: Manifest, spec: InferenceServiceSpec, config_file: str) -> Manifest:
    """The track's Deployment (as every feature rendered it) as a LeaderWorkerSet of podsPerReplica-pod groups."""
    dep_spec = deployment["spec"]
    template = dep_spec["template"]
    rolling = dep_spec.get("strategy", {}).get("rollingUpdate") or {"maxSurge": 0, "maxUnavailable": 1}
    metadata = copy.deepcopy(deployment["metadata"])
    metadata["name"] = group_set_name(metadata["name"])
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": dep_spec["replicas"],
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": rolling["maxSurge"], "maxUnavailable": _at_least_one(rolling["maxUnavailable"]),
                },
            },
            "leaderWorkerTemplate": {
                "size": pods_per_replica(spec),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader_template(template),
                "workerTemplate": worker_template(template, config_file),
            },
        },
    }


def deployment_view(lws: Manifest | None) -> Manifest | None:
    """A LeaderWorkerSet as the rollout, status and autoscaling code reads a Deployment: spec.replicas and the
    status counts are groups; the leader's template stands for the pod template (its config-hash annotation).
    LWS reports no observedGeneration: its status is taken as current (LWS recomputes it on every change of the
    object, well within a pass), and a group is available once ready, as LWS's own Available condition counts."""
    if lws is None:
        return None
    status: dict[str, Any] = lws.get("status") or {}
    ready = int(status.get("readyReplicas", 0))
    view_status: Manifest = {
        "observedGeneration": int(lws.get("metadata", {}).get("generation", 0)),
        "replicas": int(status.get("replicas", 0)),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "updatedReplicas": int(status.get("updatedReplicas", 0)),
    }
    template = lws["spec"]["leaderWorkerTemplate"].get("leaderTemplate") or lws["spec"]["leaderWorkerTemplate"][
        "workerTemplate"
    ]
    return {
        "apiVersion": lws["apiVersion"],
        "kind": lws["kind"],
        "metadata": lws["metadata"],
        "spec": {"replicas": int(lws["spec"].get("replicas", 1)), "template": template},
        "status": view_status,
    }
