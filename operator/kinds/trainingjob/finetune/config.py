"""spec.finetune -> the trainer's FinetuneSpec, and where the adapter is exported (pure)."""

from __future__ import annotations

from loom.workloads.trainer import config as trainer

from ....core.model import InvalidSpec
from ..api import TrainingJobSpec
from .api import Finetune

ADAPTER_EXPORT = "final"  # <checkpoint.uri>/final: adapter_config.json + adapter_model.safetensors


def adapter_export_uri(spec: TrainingJobSpec) -> str | None:
    """Where a fine-tuning job exports its adapter (None: not a fine-tuning job, or no checkpoint)."""
    if spec.finetune is None or spec.checkpoint is None:
        return None
    return f"{spec.checkpoint.uri.rstrip('/')}/{ADAPTER_EXPORT}"


def trainer_finetune(spec: TrainingJobSpec) -> trainer.FinetuneSpec | None:
    """The trainer's FinetuneSpec; the base must be resolved (see resolve_base) and its tracking URI known."""
    finetune: Finetune | None = spec.finetune
    if finetune is None:
        return None
    base = finetune.base_model
    if base.from_training_job is not None:
        raise InvalidSpec(f"finetune.baseModel.fromTrainingJob {base.from_training_job.name} is not resolved yet")
    tracking_uri = base.tracking_uri
    if base.mlflow is not None and tracking_uri is None and spec.tracking is not None and spec.tracking.mlflow:
        tracking_uri = spec.tracking.mlflow.tracking_uri
    if base.mlflow is not None and tracking_uri is None:
        raise InvalidSpec("finetune.baseModel.mlflow needs an MLflow tracking URL: set finetune.baseModel.trackingUri "
                          "or tracking.mlflow")
    return trainer.FinetuneSpec(
        method=finetune.method,
        base_model=trainer.BaseModelSpec(uri=base.uri, mlflow=base.mlflow, endpoint=base.endpoint,
                                         tracking_uri=tracking_uri),
        rank=finetune.rank,
        alpha=finetune.alpha,
        dropout=finetune.dropout,
        target_modules=list(finetune.target_modules),
    )
