"""spec.finetune and status.baseModel of a TrainingJob: a LoRA adapter trained on a frozen base model
(base_model.py)."""

from __future__ import annotations

from pydantic import Field

from loom.workloads.trainer import config as trainer

from ....core.model import ApiModel, DnsName, cel, validations

FINETUNE_NEEDS_CHECKPOINT = (
    "finetune needs checkpoint: the adapter is checkpointed under checkpoint.uri and exported to <checkpoint.uri>/final"
)


class BaseModelFromTrainingJob(ApiModel):
    """Another TrainingJob's final export (its checkpoint.exportFormat must be huggingface); this job waits until
    that one has succeeded."""

    name: DnsName = Field(description="TrainingJob name in this namespace.")


class FinetuneBaseModel(ApiModel):
    """The frozen model the adapter is trained on: a Hugging Face-format folder (config.json, *.safetensors and the
    tokenizer files). Read with this job's S3 credentials (checkpoint.secretRef)."""

    model_config = validations(
        cel(
            "[has(self.uri), has(self.mlflow), has(self.fromTrainingJob)].filter(x, x).size() == 1",
            "set exactly one of uri, mlflow or fromTrainingJob",
        ),
    )

    uri: trainer.S3FolderUri | None = Field(None, description="s3://bucket/prefix of a Hugging Face-format folder.")
    mlflow: trainer.MlflowModelUri | None = Field(
        None,
        description="MLflow registry model: models:/name/version, models:/name/latest or models:/name@alias (its "
        "version's source folder, e.g. what another TrainingJob's register published).",
    )
    from_training_job: BaseModelFromTrainingJob | None = None
    endpoint: str | None = Field(
        None, description="S3 endpoint URL of the base model (default: checkpoint.endpoint; for fromTrainingJob: that "
        "job's).", max_length=1024,
    )
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URL for mlflow (default: tracking.mlflow.trackingUri, then the operator's, "
        "defaults.mlflow.trackingUri).", max_length=1024,
    )


class Finetune(ApiModel):
    """Parameter-efficient fine-tuning with LoRA (peft) on the existing engines: the base model is frozen, only the
    adapter trains; checkpoints hold the adapter and its optimizer state (not the base), and the export at
    <checkpoint.uri>/final is the adapter in peft's format (adapter_config.json, adapter_model.safetensors), which
    vLLM loads as a LoRA adapter. The entrypoint's task builds the base's architecture with Hugging Face's module
    names (as loom.workloads.trainer.examples.instructions does). Frozen once the job has started (its checkpoints
    hold this adapter)."""

    method: trainer.FinetuneMethod = Field(
        "lora", description="lora; qlora (the base quantized to 4 bits with bitsandbytes) needs GPU workers."
    )
    base_model: FinetuneBaseModel
    rank: trainer.LoraRank = Field(trainer.DEFAULT_LORA_RANK, description="LoRA rank r (vLLM serves ranks up to its "
                                   "--max-lora-rank).")
    alpha: trainer.LoraAlpha = Field(trainer.DEFAULT_LORA_ALPHA, description="LoRA alpha: the update is scaled by "
                                     "alpha / rank.")
    dropout: trainer.LoraDropout = Field(trainer.DEFAULT_LORA_DROPOUT, description="Dropout on the LoRA input.")
    target_modules: list[trainer.TargetModule] = Field(
        default_factory=lambda: list(trainer.DEFAULT_TARGET_MODULES), min_length=1, max_length=64,
        description="Module names the adapter wraps (peft's target_modules), e.g. q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj.",
    )


class BaseModelStatus(ApiModel):
    """finetune.baseModel.fromTrainingJob as resolved when the job first started: kept, so a later change to (or
    deletion of) that job never changes the base under a running or resumed fine-tune."""

    training_job: str | None = None
    uri: str = Field(description="The base model's folder (the job's final export).")
    endpoint: str | None = None
