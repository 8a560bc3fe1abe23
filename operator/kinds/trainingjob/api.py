"""TrainingJob: a DeepSpeed or FSDP training run that recovers from lost pods by resuming from checkpoints.

Each feature package declares its own fields' models (data/, finetune/, queue/, registration/, tracking/: api.py);
this module puts them together into the spec and the status.

Fields the trainer also reads take their enums, limits and defaults from the trainer's own config model
(loom.workloads.trainer.config): one definition, checked by tests/unit/test_contracts.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loom.workloads.trainer import config as trainer

from ...core.kind import AGE, PHASE, Kind, NameRule, PrinterColumn
from ...core.model import (
    ApiModel,
    EnvVar,
    FreeForm,
    ResourceRequirements,
    S3Credentials,
    StatusBase,
    Toleration,
    cel,
    validations,
)
from .data.api import TrainingData, TrainingDataStatus
from .finetune.api import FINETUNE_NEEDS_CHECKPOINT, BaseModelStatus, Finetune
from .queue.api import QueueStatus
from .registration.api import Register, RegisteredModel
from .tracking.api import MlflowRun, Tracking

TrainingPhase = Literal["Pending", "Queued", "Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]


class Entrypoint(ApiModel):
    """What each worker runs under torchrun: a Python module, or a command with arguments."""

    model_config = validations(
        cel("has(self.module) != has(self.command)", "set exactly one of module or command"),
    )

    module: trainer.EntrypointRef | None = Field(
        None,
        description="Python entry of the user's training task, 'package.module:function'. "
        "Default image ships the bundled example 'loom.workloads.trainer.examples.chargpt:task'.",
        max_length=512,
    )
    command: list[str] | None = Field(None, description="A command to run instead of a module.", max_length=64)
    args: list[str] = Field(default_factory=list, description="Arguments passed to the task.", max_length=256)


class Workers(ApiModel):
    """How many workers, on what hardware. Elastic between minReplicas and maxReplicas."""

    model_config = validations(
        cel(
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must be <= replicas",
            field_path=".minReplicas",
        ),
        cel(
            "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            "maxReplicas must be >= replicas",
            field_path=".maxReplicas",
        ),
    )

    replicas: int = Field(1, ge=1, le=1024, description="Workers started (one pod each).")
    min_replicas: int | None = Field(
        None, ge=1, le=1024, description="Fewest workers training may continue with (default: replicas)."
    )
    max_replicas: int | None = Field(None, ge=1, le=1024, description="Most workers (default: replicas).")
    gpus_per_worker: int = Field(0, ge=0, le=16, description="nvidia.com/gpu per worker; 0 trains on CPU (gloo).")
    resources: ResourceRequirements | None = Field(
        None,
        description="CPU/memory of each worker container. Its CPU limit (else request, else 1) also sets "
        "OMP_NUM_THREADS, PyTorch's CPU threads, unless env names it.",
    )
    node_selector: dict[str, str] | None = Field(None, description="Node labels every worker requires.")
    tolerations: list[Toleration] | None = Field(None, description="Tolerations of every worker.", max_length=32)


class DeepSpeedOptions(ApiModel):
    """DeepSpeed engine settings; `config` is a raw ds_config merged last (it wins)."""

    zero_stage: trainer.ZeroStage = Field(trainer.DEFAULT_ZERO_STAGE, description="ZeRO stage 0-3.")
    offload: trainer.Offload = Field(
        trainer.DEFAULT_OFFLOAD, description="Offload optimizer (and params at stage 3) to CPU."
    )
    bf16: bool = Field(trainer.DEFAULT_BF16, description="Train in bfloat16.")
    config: FreeForm | None = Field(None, description="Raw ds_config passthrough, merged over the generated one.")


class FsdpOptions(ApiModel):
    """FSDP2 (fully_shard) engine settings."""

    sharding: trainer.FsdpSharding = Field(trainer.DEFAULT_SHARDING, description="How parameters are sharded.")
    mixed_precision: trainer.MixedPrecision = Field(trainer.DEFAULT_MIXED_PRECISION, description="Compute dtype.")
    activation_checkpointing: bool = Field(
        trainer.DEFAULT_ACTIVATION_CHECKPOINTING, description="Recompute activations in backward."
    )


class CheckpointSpec(ApiModel):
    """Sharded checkpoints in S3-compatible object storage; every restart resumes from the newest complete one."""

    model_config = validations(
        cel(
            "self.resume in ['latest', 'none'] || self.resume.startsWith('s3://')",
            "resume must be latest, none, or an s3:// URI",
            field_path=".resume",
        ),
    )

    uri: trainer.CheckpointUri = Field(
        description="s3://bucket/prefix under which checkpoints are written.", max_length=1024
    )
    endpoint: str | None = Field(
        None,
        description="S3 endpoint URL for non-AWS stores (default: the operator's, chart value defaults.s3.endpoint).",
        max_length=1024,
    )
    secret_ref: S3Credentials | None = Field(
        None, description="Secret with the S3 credentials (default: the operator's, defaults.s3.secretName)."
    )
    every_steps: trainer.Steps | None = Field(None, description="Save every N steps.")
    every_minutes: trainer.Minutes | None = Field(
        None, description="Save at least every N minutes (fractions allowed)."
    )
    async_: bool = Field(
        trainer.DEFAULT_ASYNC_CHECKPOINT,
        alias="async",
        description="Upload in the background; training blocks only to stage.",
    )
    # At most 1000 here (the trainer has no limit): admission keeps a typo from keeping every checkpoint.
    keep_last: trainer.KeepLast = Field(
        trainer.DEFAULT_KEEP_LAST, le=1000, description="Complete checkpoints kept; older ones are deleted."
    )
    resume: str = Field(
        trainer.DEFAULT_RESUME, description="latest | none | an explicit s3:// checkpoint URI.", max_length=1024
    )
    export_format: trainer.ExportFormat = Field(
        "loom",
        description="Format of the final export at <uri>/final: loom (model.pt + config.json) or huggingface (a "
        "Hugging Face folder, which an InferenceService with runtime vllm serves; the task must write it, as the "
        "bundled Llama example does).",
    )




class RunPolicy(ApiModel):
    """Lifecycle limits."""

    backoff_limit: int = Field(3, ge=0, le=1000, description="Failures tolerated before the job fails. Never resets.")
    active_deadline_seconds: int | None = Field(None, ge=1, description="Fail the job after this long running.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete pods and services this long after finishing (checkpoints are kept)."
    )
    suspend: bool = Field(False, description="Checkpoint and stop the workers; false resumes from the checkpoint.")


class Scheduling(ApiModel):
    """Placement: gang scheduling and scheduler choice."""

    gang: Literal["none", "volcano", "scheduler-plugins"] = Field(
        "none", description="Create a PodGroup for this scheduler so workers start all-or-nothing."
    )
    scheduler_name: str | None = Field(None, description="Pods' schedulerName.", max_length=253)
    priority_class_name: str | None = Field(None, description="Pods' priorityClassName.", max_length=253)
    queue: str | None = Field(None, description="Queue name for the gang scheduler.", max_length=253)
    schedule_timeout_seconds: int = Field(
        300, ge=1, description="Report Unschedulable when workers cannot all start within this."
    )







class TrainingJobSpec(ApiModel):
    model_config = validations(
        cel("self.engine == oldSelf.engine", "engine is immutable", field_path=".engine"),
        cel("!has(self.register) || (has(self.checkpoint) && has(self.tracking) && has(self.tracking.mlflow))",
            "register needs checkpoint (where the model is exported) and tracking.mlflow (the registry)",
            field_path=".register"),
        cel(
            "!has(self.deepspeed) || self.engine == 'deepspeed'",
            "deepspeed options need engine: deepspeed",
            field_path=".deepspeed",
        ),
        cel("!has(self.fsdp) || self.engine == 'fsdp'", "fsdp options need engine: fsdp", field_path=".fsdp"),
        cel("!has(self.finetune) || has(self.checkpoint)", FINETUNE_NEEDS_CHECKPOINT, field_path=".finetune"),
        cel("!has(self.finetune) || !has(self.finetune.method) || self.finetune.method != 'qlora' || "
            "(has(self.workers) && has(self.workers.gpusPerWorker) && self.workers.gpusPerWorker > 0)",
            trainer.QLORA_NEEDS_GPU, field_path=".finetune.method"),
        cel("!has(self.finetune) || !has(self.checkpoint) || !has(self.checkpoint.exportFormat) || "
            "self.checkpoint.exportFormat != 'huggingface'", trainer.FINETUNE_EXPORTS_ADAPTER,
            field_path=".checkpoint.exportFormat"),
    )

    engine: trainer.Engine = Field(description="Distributed engine: deepspeed or fsdp. Immutable.")
    image: str | None = Field(None, description="Worker image (default: the operator's trainer image).")
    entrypoint: Entrypoint = Field(description="The training task each worker runs.")
    max_steps: trainer.Steps | None = Field(
        None,
        description=f"Optimizer steps to train; the run succeeds after them (default {trainer.DEFAULT_MAX_STEPS}).",
    )
    env: list[EnvVar] | None = Field(None, description="Extra environment for the workers.", max_length=128)
    workers: Workers = Field(default_factory=Workers)
    deepspeed: DeepSpeedOptions | None = None
    fsdp: FsdpOptions | None = None
    checkpoint: CheckpointSpec | None = Field(None, description="Without it a lost worker restarts from step 0.")
    tracking: Tracking | None = None
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    success_policy: Literal["AllWorkers", "Worker0"] = Field(
        "AllWorkers", description="Succeeded when all workers exit 0, or as soon as worker 0 does."
    )
    training_data: TrainingData | None = Field(
        None, description="Build a point-in-time training set from a FeatureView before the workers start."
    )
    finetune: Finetune | None = Field(
        None, description="Train a LoRA adapter on a frozen base model instead of the whole model."
    )
    # `register` on the wire; another name in Python, where it would shadow ABCMeta.register.
    registration: Register | None = Field(
        None, alias="register",
        description="Register the exported model in the MLflow model registry when the job succeeds.",
    )


class WorkerCounts(ApiModel):
    desired: int = 0
    ready: int = 0


class CheckpointStatus(ApiModel):
    latest: str | None = Field(None, description="URI of the newest complete checkpoint.")
    step: int | None = None
    time: str | None = None


class Progress(ApiModel):
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    samples_per_second: float | None = None
    eta: str | None = Field(None, description="Estimated time left, e.g. 12m30s.")






class TrainingJobStatus(StatusBase):
    phase: TrainingPhase | None = None
    workers: WorkerCounts | None = None
    restarts: int = Field(0, description="Recoveries so far: gang restarts plus single-worker replacements.")
    failures: int = Field(0, description="Failures counted against runPolicy.backoffLimit (never reset).")
    attempt: int = Field(0, description="Gang attempt; worker pods labelled with an older one are restart leftovers.")
    replaced_pods: list[str] = Field(
        default_factory=list,
        description="UIDs of failed or lost worker pods already accounted for, kept until those pods are gone.",
        max_length=2048,
    )
    children_deleted: bool | None = Field(None, description="ttlSecondsAfterFinished removed the pods and services.")
    checkpoint: CheckpointStatus | None = None
    progress: Progress | None = None
    mlflow: MlflowRun | None = None
    start_time: str | None = None
    completion_time: str | None = None
    training_data: TrainingDataStatus | None = None
    queue: QueueStatus | None = None
    registered_model: RegisteredModel | None = None
    base_model: BaseModelStatus | None = Field(None, description="finetune's base model from another TrainingJob.")


class TrainingJob(ApiModel):
    """A distributed training run (DeepSpeed or FSDP) that survives lost pods and nodes."""

    api_version: Literal["loom.dev/v1alpha1"] = "loom.dev/v1alpha1"
    kind: Literal["TrainingJob"] = "TrainingJob"
    metadata: FreeForm = Field(default_factory=dict)
    spec: TrainingJobSpec
    status: TrainingJobStatus | None = None


# The kind as Kubernetes shows it (the CRD's names, columns and name rule; api/kinds.py lists every kind).
TRAINING_JOB = Kind(
    kind="TrainingJob",
    plural="trainingjobs",
    singular="trainingjob",
    short_names=("ltj",),
    model=TrainingJob,
    spec=TrainingJobSpec,
    status=TrainingJobStatus,
    columns=(
        PrinterColumn("Engine", ".spec.engine"),
        PHASE,
        PrinterColumn("Ready", ".status.workers.ready", "integer", description="Workers ready"),
        PrinterColumn("Desired", ".status.workers.desired", "integer", description="Workers desired"),
        PrinterColumn("Step", ".status.progress.step", "integer"),
        PrinterColumn("Total", ".status.progress.totalSteps", "integer"),
        PrinterColumn("Restarts", ".status.restarts", "integer"),
        PrinterColumn("Loss", ".status.progress.loss", "number", priority=1),
        PrinterColumn("Checkpoint", ".status.checkpoint.latest", priority=1),
        PrinterColumn("Queue", ".status.queue.name", priority=1, description="Kueue LocalQueue"),
        PrinterColumn("Admission", ".status.queue.state", priority=1, description="Queued, Admitted or Evicting"),
        PrinterColumn("Flavor", ".status.queue.flavor", priority=1, description="Kueue ResourceFlavor admitted"),
        PrinterColumn("Position", ".status.queue.position", "integer", priority=1, description="Place in the queue"),
        PrinterColumn("Registered", ".status.registeredModel.version", priority=1),
        AGE,
    ),
    # The controller also checks the last worker's hostname against the job's worker count (11 workers or more
    # need a shorter name).
    name_rule=NameRule(
        54, dns_label=True, why="its workers' hostnames are <name>-worker-<index> and their Service <name>-workers"
    ),
)
