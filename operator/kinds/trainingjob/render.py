"""TrainingJob -> its children: headless Service, trainer ConfigMap, one Pod per worker, optional PodGroup (pure).

Names are deterministic (Service `<job>-workers`, ConfigMap `<job>-trainer`, Pods `<job>-worker-<i>`, PodGroup
`<job>`) so a re-run after an operator crash converges on the same objects instead of creating new ones. Every
pod carries the gang attempt it belongs to (label ATTEMPT_LABEL): after a gang restart the controller knows
which pods are stale.
"""

from __future__ import annotations

from ...core.kit import (
    Manifest,
    child_metadata,
    cpu_threads_env,
    merge_env,
    owner_of,
    restricted_security_context,
    s3_env,
)
from .api import TRAINING_JOB, TrainingJobSpec
from .config import (
    CONFIG_DIR,
    CONFIG_FILE,
    PROGRESS_PORT,
    RENDEZVOUS_PORT,
    rendezvous_endpoint,
    rendezvous_service_name,
    torchrun_command,
    trainer_config,
    worker_range,
)
from .data.retrieval import worker_env

KIND = "TrainingJob"
WORKER = "worker"
JOB_LABEL = "loom.dev/trainingjob"
INDEX_LABEL = "loom.dev/worker-index"
ATTEMPT_LABEL = "loom.dev/attempt"
# The trainer gets SIGTERM on suspend and gang restarts; this is its window for the final checkpoint.
TERMINATION_GRACE_SECONDS = 120
# torchrun's agent forwards SIGTERM to the trainer processes and SIGKILLs them after its shutdown timeout, 30 s
# unless told otherwise: a final checkpoint slower than that would be cut short inside the pod's grace period.
# The agent gets the grace period less 10 s (it still exits before the kubelet's SIGKILL).
TORCHRUN_SHUTDOWN_SECONDS = TERMINATION_GRACE_SECONDS - 10
GPU_RESOURCE = "nvidia.com/gpu"

VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
GANG_SCHEDULERS = {"volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler"}


def worker_name(job_name: str, index: int) -> str:
    return f"{job_name}-worker-{index}"


def config_map_name(job_name: str) -> str:
    return f"{job_name}-trainer"


def name_problem(job_name: str, max_workers: int) -> str | None:
    """Why this job name cannot name its Service and worker hostnames (DNS-1035 labels), or None."""
    if (problem := TRAINING_JOB.name_rule.problem(job_name)) is not None:  # what the CRD checks
        return problem
    longest = worker_name(job_name, max_workers - 1)  # what depends on the worker count
    if len(longest) > 63:
        return f"name too long: {longest!r} exceeds 63 characters (DNS label); use a shorter TrainingJob name"
    return None


def headless_service(job: Manifest) -> Manifest:
    """Gives each worker a stable DNS name; not-ready addresses are published so rendezvous works early."""
    owner = owner_of(job, KIND)
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, rendezvous_service_name(name), "rendezvous"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: name, "app.kubernetes.io/component": WORKER},
            "ports": [
                {"name": "c10d", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"},
                {"name": "progress", "port": PROGRESS_PORT, "targetPort": PROGRESS_PORT, "protocol": "TCP"},
            ],
        },
    }


def config_map(job: Manifest, spec: TrainingJobSpec) -> Manifest:
    """The rendered TrainerConfig; it never holds credentials (those come from the Secret as env)."""
    owner = owner_of(job, KIND)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, config_map_name(owner["metadata"]["name"]), "trainer-config"),
        "data": {CONFIG_FILE: trainer_config(spec).to_json()},
    }


def pod_group(job: Manifest, spec: TrainingJobSpec) -> Manifest | None:
    """A PodGroup for the gang scheduler named in spec.scheduling.gang, or None."""
    gang = spec.scheduling.gang
    if gang == "none":
        return None
    owner = owner_of(job, KIND)
    name = owner["metadata"]["name"]
    low, _ = worker_range(spec)
    meta = child_metadata(owner, name, "podgroup")
    if gang == "volcano":
        group_spec: Manifest = {"minMember": low}
        if spec.scheduling.queue:
            group_spec["queue"] = spec.scheduling.queue
        if spec.scheduling.priority_class_name:
            group_spec["priorityClassName"] = spec.scheduling.priority_class_name
        if spec.workers.gpus_per_worker:
            group_spec["minResources"] = {GPU_RESOURCE: str(low * spec.workers.gpus_per_worker)}
        return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": group_spec}
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": meta,
        "spec": {"minMember": low, "scheduleTimeoutSeconds": spec.scheduling.schedule_timeout_seconds},
    }


def _env(job: Manifest, spec: TrainingJobSpec, index: int, attempt: int, mlflow_run_id: str | None) -> list[Manifest]:
    name = job["metadata"]["name"]
    env: list[Manifest] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "LOOM_TRAININGJOB", "value": name},
        {"name": "LOOM_WORKER_INDEX", "value": str(index)},
        # The gang attempt: torchrun's own restart count starts at 0 again in every new gang's pods.
        {"name": "LOOM_GANG_ATTEMPT", "value": str(attempt)},
        {"name": "LOOM_TRAINER_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "LOOM_RENDEZVOUS_ENDPOINT", "value": rendezvous_endpoint(name, job["metadata"]["namespace"])},
        # The image's working directory must never shadow stdlib modules (the repo has a folder `operator`).
        {"name": "PYTHONSAFEPATH", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(TORCHRUN_SHUTDOWN_SECONDS)},
        *cpu_threads_env(spec.workers.resources),
    ]
    ckpt = spec.checkpoint
    if ckpt is not None:
        env += s3_env(ckpt.secret_ref, ckpt.endpoint)
    # After the checkpoint's keys: trainingData's own Secret, when it names one, is what reads the training set.
    env = list({item["name"]: item for item in env + worker_env(spec, job["metadata"]["namespace"], name)}.values())
    if spec.tracking is not None and spec.tracking.mlflow is not None:
        env.append({"name": "MLFLOW_TRACKING_URI", "value": spec.tracking.mlflow.tracking_uri})
        env.append({"name": "MLFLOW_EXPERIMENT_NAME", "value": spec.tracking.mlflow.experiment})
        if mlflow_run_id:
            env.append({"name": "MLFLOW_RUN_ID", "value": mlflow_run_id})
    return merge_env(env, spec.env)


def _resources(spec: TrainingJobSpec) -> Manifest:
    resources = spec.workers.resources.to_wire() if spec.workers.resources else {}
    gpus = spec.workers.gpus_per_worker
    if gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
        resources.setdefault("requests", {})[GPU_RESOURCE] = gpus
    return resources


def worker_pod(
    job: Manifest, spec: TrainingJobSpec, index: int, *, attempt: int, image: str, mlflow_run_id: str | None
) -> Manifest:
    """Worker `index` of gang attempt `attempt`. restartPolicy Never: the controller owns every restart."""
    owner = owner_of(job, KIND)
    job_name = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    extra = {INDEX_LABEL: str(index), ATTEMPT_LABEL: str(attempt), JOB_LABEL: job_name}
    annotations: dict[str, str] = {}
    scheduling = spec.scheduling
    if scheduling.gang == "volcano":
        annotations[VOLCANO_GROUP_ANNOTATION] = job_name
    elif scheduling.gang == "scheduler-plugins":
        extra[COSCHEDULING_GROUP_LABEL] = job_name
    container: Manifest = {
        "name": "trainer",
        "image": spec.image or image,
        "command": torchrun_command(
            spec, job_name=job_name, namespace=namespace, job_uid=owner["metadata"]["uid"], index=index
        ),
        "env": _env(job, spec, index, attempt, mlflow_run_id),
        "ports": [
            {"name": "c10d", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
            {"name": "progress", "containerPort": PROGRESS_PORT, "protocol": "TCP"},
        ],
        "volumeMounts": [
            {"name": "trainer-config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": "/tmp"},
        ],
        "securityContext": restricted_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    volumes: list[Manifest] = [
        {"name": "trainer-config", "configMap": {"name": config_map_name(job_name)}},
        {"name": "scratch", "emptyDir": {}},
    ]
    if spec.workers.gpus_per_worker:
        # NCCL needs more shared memory than the container runtime's 64 MiB default.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "hostname": worker_name(job_name, index),
        "subdomain": rendezvous_service_name(job_name),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
        "containers": [container],
        "volumes": volumes,
    }
    workers = spec.workers
    if workers.node_selector:
        pod_spec["nodeSelector"] = dict(workers.node_selector)
    if workers.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in workers.tolerations]
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    scheduler = scheduling.scheduler_name or GANG_SCHEDULERS.get(scheduling.gang)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(
            owner, worker_name(job_name, index), WORKER, extra_labels=extra, annotations=annotations or None
        ),
        "spec": pod_spec,
    }
