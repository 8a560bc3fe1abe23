"""TrainingJob -> the trainer's own config model and the torchrun command line (pure).

The trainer's pydantic model (loom.workloads.trainer.config.TrainerConfig) is the contract: the operator
builds it by keyword from the spec's typed fields, never through a look-alike dict, so mypy catches a field
the trainer does not know and the trainer's own validators run here, in a unit test, instead of inside a pod.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from loom.workloads.trainer import config as trainer

from ...core.model import InvalidSpec
from .api import CheckpointSpec, DeepSpeedOptions, FsdpOptions, TrainingJobSpec
from .finetune.config import trainer_finetune
from .tracking.api import Tracking

CONFIG_DIR = "/etc/loom/trainer"
CONFIG_FILE = "config.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
RENDEZVOUS_PORT = 29400
# The trainer's rank 0 serves Prometheus metrics and its progress document on this port.
PROGRESS_PORT = 9400
# torchrun's own budget for restarting the local workers after a peer joins or leaves (elastic
# re-rendezvous). Real pod failures are counted by the operator against runPolicy.backoffLimit.
AGENT_MAX_RESTARTS = 3


# The spec cannot be turned into a trainer config; reported as a condition, never retried.
SpecError = InvalidSpec


def worker_range(spec: TrainingJobSpec) -> tuple[int, int]:
    """(min, max) workers torchrun's rendezvous accepts."""
    workers = spec.workers
    low = workers.min_replicas or workers.replicas
    high = max(workers.max_replicas or workers.replicas, workers.replicas)
    return low, high


def task_args(args: list[str]) -> dict[str, Any]:
    """`key=value` arguments -> the task's args dict; values that parse as JSON keep their type."""
    parsed: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise SpecError(f"entrypoint.args entry {arg!r} is not key=value")
        try:
            parsed[key] = json.loads(raw)
        except json.JSONDecodeError:
            parsed[key] = raw
    return parsed


def trainer_config(spec: TrainingJobSpec) -> trainer.TrainerConfig:
    """The TrainerConfig every worker reads from the ConfigMap."""
    module = spec.entrypoint.module
    try:
        return trainer.TrainerConfig(
            engine=spec.engine,
            # A command entrypoint never reads the config's entrypoint: the trainer's default stays.
            entrypoint=module if module is not None else trainer.DEFAULT_ENTRYPOINT,
            deepspeed=_deepspeed(spec.deepspeed),
            fsdp=_fsdp(spec.fsdp),
            training=trainer.TrainingSpec(
                max_steps=spec.max_steps if spec.max_steps is not None else trainer.DEFAULT_MAX_STEPS,
                device="cuda" if spec.workers.gpus_per_worker > 0 else "cpu",
                task_args=task_args(spec.entrypoint.args) if module is not None else {},
            ),
            checkpoint=_checkpoint(spec.checkpoint),
            output=trainer.OutputSpec(format=spec.checkpoint.export_format if spec.checkpoint else "loom"),
            tracking=_tracking(spec.tracking),
            progress=trainer.ProgressSpec(metrics_port=PROGRESS_PORT),
            finetune=trainer_finetune(spec),
        )
    except ValidationError as error:
        raise SpecError(f"the trainer rejects this spec: {error}") from error


def _deepspeed(options: DeepSpeedOptions | None) -> trainer.DeepSpeedSpec:
    if options is None:
        return trainer.DeepSpeedSpec()
    return trainer.DeepSpeedSpec(
        zero_stage=options.zero_stage, offload=options.offload, bf16=options.bf16, config=options.config or {}
    )


def _fsdp(options: FsdpOptions | None) -> trainer.FSDPSpec:
    if options is None:
        return trainer.FSDPSpec()
    return trainer.FSDPSpec(
        sharding=options.sharding,
        mixed_precision=options.mixed_precision,
        activation_checkpointing=options.activation_checkpointing,
    )


def _checkpoint(checkpoint: CheckpointSpec | None) -> trainer.CheckpointSpec | None:
    if checkpoint is None:
        return None
    return trainer.CheckpointSpec(
        uri=checkpoint.uri,
        endpoint=checkpoint.endpoint,
        every_steps=checkpoint.every_steps,
        every_minutes=checkpoint.every_minutes,
        async_=checkpoint.async_,
        keep_last=checkpoint.keep_last,
        resume=checkpoint.resume,
    )


def _tracking(tracking: Tracking | None) -> trainer.TrackingSpec:
    if tracking is None or tracking.mlflow is None:
        return trainer.TrackingSpec()
    # The run id is not rendered here: it arrives as MLFLOW_RUN_ID so the ConfigMap never changes with it.
    return trainer.TrackingSpec(
        mlflow=trainer.MLflowSpec(tracking_uri=tracking.mlflow.tracking_uri, experiment=tracking.mlflow.experiment)
    )


def samples_per_step(spec: TrainingJobSpec, workers: int) -> int | None:
    """Global batch of one optimizer step: per-rank batch x ranks (None when the spec cannot render)."""
    try:
        batch: int = trainer_config(spec).training.batch_size
    except SpecError:
        return None
    nproc = spec.workers.gpus_per_worker or 1
    return batch * max(1, workers) * nproc


def rendezvous_service_name(job_name: str) -> str:
    """The headless Service of a job's workers. Suffixed, so an InferenceService of the same name (train-to-serve
    naturally reuses names) keeps its own Service."""
    return f"{job_name}-workers"


def worker_address(job_name: str, namespace: str, index: int) -> str:
    """A worker's stable DNS name through the headless Service (hostname.subdomain.namespace.svc)."""
    return f"{job_name}-worker-{index}.{rendezvous_service_name(job_name)}.{namespace}.svc"


def rendezvous_endpoint(job_name: str, namespace: str) -> str:
    """worker-0's stable DNS name: the c10d store lives there."""
    return f"{worker_address(job_name, namespace, 0)}:{RENDEZVOUS_PORT}"


def torchrun_command(spec: TrainingJobSpec, *, job_name: str, namespace: str, job_uid: str, index: int) -> list[str]:
    """The worker container's command: torchrun's elastic agent around the trainer launcher."""
    low, high = worker_range(spec)
    nproc = spec.workers.gpus_per_worker if spec.workers.gpus_per_worker > 0 else 1
    command = [
        "torchrun",
        f"--nnodes={low}:{high}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_endpoint(job_name, namespace)}",
        f"--rdzv-id={job_uid}",
        # worker-0 hosts the store explicitly: torchrun's hostname guess misses when the pod's FQDN
        # carries the cluster domain and the endpoint does not.
        f"--rdzv-conf=is_host={1 if index == 0 else 0}",
        f"--max-restarts={AGENT_MAX_RESTARTS}",
        # torchrun ranks agents by sorting their addresses: the stable DNS names make worker 0 always rank 0
        # (the trainer's progress endpoint and MASTER_ADDR live there), whatever IPs the pods got.
        f"--local-addr={worker_address(job_name, namespace, index)}",
    ]
    if spec.entrypoint.command:
        return [*command, "--no-python", *spec.entrypoint.command, *spec.entrypoint.args]
    return [*command, "-m", "loom.workloads.trainer", "--config", CONFIG_PATH]
