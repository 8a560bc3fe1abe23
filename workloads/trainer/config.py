"""The trainer's configuration: the one contract between the operator (which renders it into a ConfigMap)
and the pods (which read it). Importable without torch so the operator can use it.

Credentials are never part of this model: S3 keys arrive as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from
a Secret, and the MLflow run id as MLFLOW_RUN_ID.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from loom.workloads.common.config import CamelModel, WorkloadConfig

# Exit codes of a trainer worker (and of the launcher). The operator imports these: 0 is success,
# EXIT_PERMANENT means retrying cannot help (bad config, user code that cannot be imported or is broken),
# anything else is treated as retryable (lost peer, storage hiccup, preemption).
EXIT_OK = 0
EXIT_RETRYABLE = 1
EXIT_PERMANENT = 2
# SIGTERM received: a final checkpoint was written (when configured) and the worker stopped early.
EXIT_INTERRUPTED = 143

DEFAULT_ENTRYPOINT = "loom.workloads.trainer.examples.chargpt:task"
DEFAULT_PROGRESS_FILE = "/tmp/loom-progress.json"


# ------------------------------------------------------------------------------------------- shared vocabulary
# Every enum, limit and default that a TrainingJob also exposes is written here, once; the operator's API
# (loom.operator.kinds.trainingjob.api) imports them, and tests/unit/test_contracts.py fails if the two drift apart.


class Engine(StrEnum):
    DEEPSPEED = "deepspeed"
    FSDP = "fsdp"


Offload = Literal["none", "cpu"]
# "none" keeps parameters replicated (DDP-like), still through FSDP2 so checkpoints take the same path.
FsdpSharding = Literal["full", "hybrid", "none"]
MixedPrecision = Literal["none", "bf16", "fp16"]
ZeroStage = Annotated[int, Field(ge=0, le=3)]
# "package.module:attribute" naming a TrainTask instance, class or zero-argument factory.
# Classes spelled out: Go's \w (admission) is ASCII, Python's is Unicode; both sides must accept the same names.
EntrypointRef = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")]
CheckpointUri = Annotated[str, Field(pattern=r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$")]
Steps = Annotated[int, Field(ge=1)]
# Fractions are fine (0.5 = every 30 seconds); the API has always accepted whole minutes, which stay valid.
Minutes = Annotated[float, Field(gt=0)]
KeepLast = Annotated[int, Field(ge=1)]

DEFAULT_ZERO_STAGE = 2
DEFAULT_OFFLOAD: Offload = "none"
DEFAULT_BF16 = False
DEFAULT_SHARDING: FsdpSharding = "full"
DEFAULT_MIXED_PRECISION: MixedPrecision = "none"
DEFAULT_ACTIVATION_CHECKPOINTING = False
DEFAULT_MAX_STEPS = 200
DEFAULT_ASYNC_CHECKPOINT = True
DEFAULT_KEEP_LAST = 3
# "latest": newest complete checkpoint under uri; "none": start fresh; or an explicit s3:// checkpoint URI.
DEFAULT_RESUME = "latest"
# MLflow's own default experiment: where a TrainingJob without tracking.mlflow.experiment has always logged.
DEFAULT_MLFLOW_EXPERIMENT = "Default"

# spec.finetune: LoRA on a frozen base model. The rank limit is vLLM's largest max_lora_rank (an adapter above it
# could not be served); the default targets are the attention projections every Llama-family model names so and
# vLLM's LoRA layers support.
FinetuneMethod = Literal["lora", "qlora"]
LoraRank = Annotated[int, Field(ge=1, le=512)]
LoraAlpha = Annotated[int, Field(ge=1, le=4096)]
LoraDropout = Annotated[float, Field(ge=0, lt=1)]
# A module name (or a dotted suffix of one) as peft matches target_modules: the last path components.
TargetModule = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$", max_length=128)]
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 16
DEFAULT_LORA_DROPOUT = 0.05
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MlflowModelUri = Annotated[str, Field(pattern=r"^models:/[^/@]+(/[0-9]+|/latest|@[A-Za-z0-9_\-]+)$", max_length=512)]
S3FolderUri = Annotated[str, Field(pattern=r"^s3://[^/]+/.+", max_length=1024)]


QLORA_NEEDS_GPU = (
    "finetune.method qlora quantizes the frozen base model to 4 bits with bitsandbytes, which runs on CUDA only: "
    "request GPUs (workers.gpusPerWorker > 0) or use method lora on CPU"
)
FINETUNE_EXPORTS_ADAPTER = (
    "finetune exports a LoRA adapter in peft's format (adapter_config.json, adapter_model.safetensors), not a "
    "Hugging Face model folder: leave checkpoint.exportFormat unset (or loom)"
)


# The trainer's config has always been mutable, unlike the other workloads' (CamelModel freezes them).
_MUTABLE = ConfigDict(frozen=False)


class _Spec(CamelModel):
    model_config = _MUTABLE


class DeepSpeedSpec(_Spec):
    zero_stage: ZeroStage = DEFAULT_ZERO_STAGE
    offload: Offload = DEFAULT_OFFLOAD
    bf16: bool = DEFAULT_BF16
    # Raw ds_config passthrough, merged over what Loom derives from the fields above.
    config: dict[str, Any] = Field(default_factory=dict)


class FSDPSpec(_Spec):
    sharding: FsdpSharding = DEFAULT_SHARDING
    mixed_precision: MixedPrecision = DEFAULT_MIXED_PRECISION
    activation_checkpointing: bool = DEFAULT_ACTIVATION_CHECKPOINTING


class TrainingSpec(_Spec):
    max_steps: Steps = DEFAULT_MAX_STEPS
    # Per-rank micro-batch size (sequences per step per rank).
    batch_size: int = Field(default=16, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    seed: int = 1234
    log_every_steps: int = Field(default=1, ge=1)
    # "auto" picks CUDA with NCCL when a GPU is visible, else CPU with gloo.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Free-form arguments for the user's task (model size, dataset path, ...).
    task_args: dict[str, Any] = Field(default_factory=dict)


class CheckpointSpec(_Spec):
    uri: CheckpointUri
    # S3-compatible endpoint URL (MinIO, Ceph...); empty means AWS's default endpoint resolution.
    endpoint: str | None = None
    every_steps: Steps | None = None
    every_minutes: Minutes | None = None
    async_: bool = Field(default=DEFAULT_ASYNC_CHECKPOINT, alias="async")
    keep_last: KeepLast | None = DEFAULT_KEEP_LAST
    resume: str = DEFAULT_RESUME
    # Local scratch space the shards are staged in before upload.
    staging_dir: str = "/tmp/loom-checkpoint-staging"
    # Save a last checkpoint when training completes or is interrupted by SIGTERM.
    save_final: bool = True

    @field_validator("resume")
    @classmethod
    def _resume_is_known(cls, value: str) -> str:
        if value in ("latest", "none") or value.startswith("s3://"):
            return value
        raise ValueError("resume must be 'latest', 'none' or an s3:// checkpoint URI")

    @property
    def bucket(self) -> str:
        return self.uri.removeprefix("s3://").split("/", 1)[0]

    @property
    def prefix(self) -> str:
        parts = self.uri.removeprefix("s3://").split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""


class MLflowSpec(_Spec):
    tracking_uri: str
    experiment: str = DEFAULT_MLFLOW_EXPERIMENT
    # Normally left empty: the operator injects MLFLOW_RUN_ID; without either a new run is created.
    run_id: str | None = None
    log_model: bool = True


class TrackingSpec(_Spec):
    mlflow: MLflowSpec | None = None


class ProgressSpec(_Spec):
    file: str = DEFAULT_PROGRESS_FILE
    # Prometheus metrics port on rank 0; None disables the endpoint.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)


class BaseModelSpec(_Spec):
    """The Hugging Face-format folder a fine-tune starts from, resolved by the operator to one of two stores.
    Read with the job's S3 credentials (the checkpoint's)."""

    uri: S3FolderUri | None = None
    mlflow: MlflowModelUri | None = None
    endpoint: str | None = None
    tracking_uri: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> BaseModelSpec:
        if (self.uri is None) == (self.mlflow is None):
            raise ValueError("finetune.baseModel: set exactly one of uri (s3://) or mlflow (models:/)")
        return self


class FinetuneSpec(_Spec):
    """Train a LoRA adapter (peft) on a frozen base model; checkpoints hold the adapter and its optimizer state
    only, and the export is the adapter in peft's format (adapter_config.json + adapter_model.safetensors)."""

    method: FinetuneMethod = "lora"
    base_model: BaseModelSpec
    rank: LoraRank = DEFAULT_LORA_RANK
    alpha: LoraAlpha = DEFAULT_LORA_ALPHA
    dropout: LoraDropout = DEFAULT_LORA_DROPOUT
    target_modules: list[TargetModule] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES), min_length=1,
                                               max_length=64)
    # Where the base model is downloaded to on every worker (once per node).
    cache_dir: str = "/tmp/loom-base-model"


ExportFormat = Literal["loom", "huggingface"]


class OutputSpec(_Spec):
    # Where the final model (weights + config) is exported; defaults to <checkpoint.uri>/final.
    uri: str | None = Field(default=None, pattern=r"^s3://")
    # loom: model.pt + config.json; huggingface: the task's Hugging Face folder (TrainTask.export_files), which the
    # vllm runtime serves.
    format: ExportFormat = "loom"


class TrainerConfig(WorkloadConfig):
    model_config = _MUTABLE
    json_indent: ClassVar[int | None] = 2
    json_exclude_none: ClassVar[bool] = True

    engine: Engine = Engine.FSDP
    entrypoint: EntrypointRef = DEFAULT_ENTRYPOINT
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    checkpoint: CheckpointSpec | None = None
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    progress: ProgressSpec = Field(default_factory=ProgressSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    finetune: FinetuneSpec | None = None

    @model_validator(mode="after")
    def _engine_options_fit(self) -> TrainerConfig:
        if self.engine is Engine.DEEPSPEED and self.deepspeed.offload == "cpu" and self.deepspeed.zero_stage == 0:
            raise ValueError("deepspeed.offload=cpu needs zeroStage >= 1")
        if self.finetune is not None and self.finetune.method == "qlora" and self.training.device != "cuda":
            raise ValueError(QLORA_NEEDS_GPU)
        if self.finetune is not None and self.output.format == "huggingface":
            raise ValueError(FINETUNE_EXPORTS_ADAPTER)
        return self

    def output_uri(self) -> str | None:
        if self.output.uri:
            return self.output.uri.rstrip("/")
        if self.checkpoint:
            return self.checkpoint.uri.rstrip("/") + "/final"
        return None


class ConfigError(Exception):
    """The configuration cannot be used; retrying will not help (maps to EXIT_PERMANENT)."""


def load_config(path: str | Path) -> TrainerConfig:
    try:
        raw = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read trainer config {path}: {error}") from error
    try:
        return TrainerConfig.from_json(raw)
    except json.JSONDecodeError as error:
        raise ConfigError(f"trainer config {path} is not valid JSON: {error}") from error
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()
        )
        raise ConfigError(f"invalid trainer config {path}: {problems}") from error
