"""finetune.baseModel.fromTrainingJob: the read of that job, on every pass until its folder is recorded in
status.baseModel (base_model.py decides from it)."""

from __future__ import annotations

from ....core import client as kube
from ....core.model import API_VERSION
from ....core.reconcile import Pass
from ....defaults import Defaulted, EndpointDefaults, training_job_manifest
from ..api import TrainingJobSpec, TrainingJobStatus
from .base_model import needs_base_job, resolve_base, with_base


async def resolve_base_model(
    ctx: Pass[Defaulted[TrainingJobSpec]], status: TrainingJobStatus, defaults: EndpointDefaults
) -> tuple[str | None, tuple[str, str] | None]:
    """finetune.baseModel.fromTrainingJob -> the concrete folder, put into the pass's spec (everything renders
    from it) and recorded in status.baseModel once found; (spec error, wait reason) otherwise."""
    assert ctx.spec is not None
    spec = ctx.spec.spec
    base_name = needs_base_job(spec, status)
    if base_name is None:
        if status.base_model is not None and spec.finetune and spec.finetune.base_model.from_training_job:
            # Resolved before (status.baseModel): the same folder on every later pass, whatever that job does.
            ctx.spec.spec = with_base(spec, status.base_model)
        return None, None
    found = await kube.get(API_VERSION, "TrainingJob", ctx.namespace, base_name)
    base_job = training_job_manifest(found, defaults) if found is not None else None
    resolution = resolve_base(spec, base_job)
    if resolution.spec is not None:
        ctx.spec.spec = resolution.spec
        status.base_model = resolution.status
    return resolution.error, resolution.wait
