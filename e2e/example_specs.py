"""Examples as the operator renders them once their references resolved: a TrainingJob that fine-tunes another
job's export (spec.finetune.baseModel.fromTrainingJob) renders only after that job succeeded, with the base
recorded in its status (operator/kinds/trainingjob/finetune/base_model.py). Tests that render every example use
this."""

from __future__ import annotations

from loom.operator.kinds.trainingjob.api import BaseModelStatus, TrainingJobSpec
from loom.operator.kinds.trainingjob.finetune.base_model import with_base


def resolved(spec: TrainingJobSpec, base_uri: str = "s3://loom-checkpoints/base/final") -> TrainingJobSpec:
    """`spec` with a fromTrainingJob base replaced by `base_uri`, as if that job had succeeded; others unchanged."""
    finetune = spec.finetune
    if finetune is None or finetune.base_model.from_training_job is None:
        return spec
    return with_base(spec, BaseModelStatus(training_job=finetune.base_model.from_training_job.name, uri=base_uri))
