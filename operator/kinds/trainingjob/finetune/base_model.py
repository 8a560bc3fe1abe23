"""finetune.baseModel.fromTrainingJob resolved against that job (pure; io.py reads the job).

A base model from another TrainingJob is that job's final export, `<its checkpoint.uri>/final` (the folder an
InferenceService's `fromTrainingJob` serves), which must be a Hugging Face folder (its checkpoint.exportFormat
huggingface) and exists once the job has succeeded. io.py reads the job; `resolve_base` says whether this
job may start (the base with the URI filled in), must wait (Pending, reason and message on Ready), or cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api import TrainingJobSpec, TrainingJobStatus
from .api import BaseModelStatus, FinetuneBaseModel


@dataclass(frozen=True)
class BaseResolution:
    """One of: `spec` (runnable: the base is a concrete s3:// or models:/ source), `wait` (reason, message), or
    `error` (the job can never run as written)."""

    spec: TrainingJobSpec | None = None
    wait: tuple[str, str] | None = None
    error: str | None = None
    status: BaseModelStatus | None = None  # what status.baseModel records (fromTrainingJob only)


def needs_base_job(spec: TrainingJobSpec, status: TrainingJobStatus) -> str | None:
    """The TrainingJob to read for the base model (None: nothing to read, or resolved before: status.baseModel)."""
    finetune = spec.finetune
    if finetune is None or finetune.base_model.from_training_job is None:
        return None
    name = finetune.base_model.from_training_job.name
    recorded = status.base_model
    return None if recorded is not None and recorded.training_job == name else name


def with_base(spec: TrainingJobSpec, base: BaseModelStatus) -> TrainingJobSpec:
    """`spec` with its fromTrainingJob base replaced by the concrete folder recorded in status."""
    assert spec.finetune is not None
    resolved = FinetuneBaseModel(uri=base.uri, endpoint=spec.finetune.base_model.endpoint or base.endpoint)
    return spec.model_copy(update={"finetune": spec.finetune.model_copy(update={"base_model": resolved})})


def resolve_base(spec: TrainingJobSpec, base_job: dict[str, Any] | None) -> BaseResolution:
    """`spec` with finetune.baseModel.fromTrainingJob replaced by that job's export (`base_job`: the job as read,
    its checkpoint's S3 fields defaulted; None when it does not exist), and the status field that records it.
    Other specs come back as they are."""
    finetune = spec.finetune
    if finetune is None or finetune.base_model.from_training_job is None:
        return BaseResolution(spec=spec)
    name = finetune.base_model.from_training_job.name
    if base_job is None:
        return BaseResolution(wait=("BaseModelNotFound", f"TrainingJob {name} (finetune.baseModel) does not exist"))
    base_spec = base_job.get("spec") or {}
    checkpoint = base_spec.get("checkpoint") or {}
    if not checkpoint.get("uri"):
        return BaseResolution(error=f"finetune.baseModel: TrainingJob {name} has no spec.checkpoint, so it exports "
                              "no model")
    if base_spec.get("finetune") is not None:
        return BaseResolution(error=f"finetune.baseModel: TrainingJob {name} fine-tunes an adapter; a base model is "
                              "a whole model (a TrainingJob with checkpoint.exportFormat: huggingface)")
    if checkpoint.get("exportFormat", "loom") != "huggingface":
        return BaseResolution(error=f"finetune.baseModel: TrainingJob {name} exports "
                              f"{checkpoint.get('exportFormat', 'loom')}, not a Hugging Face folder (set its "
                              "checkpoint.exportFormat: huggingface)")
    phase = (base_job.get("status") or {}).get("phase")
    if phase == "Failed":
        return BaseResolution(error=f"finetune.baseModel: TrainingJob {name} failed; it has no final model")
    if phase != "Succeeded":
        return BaseResolution(wait=("WaitingForBaseModel", f"TrainingJob {name} is {phase or 'Pending'}; the "
                                    "fine-tune starts from its final export once it has succeeded"))
    record = BaseModelStatus(training_job=name, uri=f"{str(checkpoint['uri']).rstrip('/')}/final",
                             endpoint=checkpoint.get("endpoint"))
    return BaseResolution(spec=with_base(spec, record), status=record)
