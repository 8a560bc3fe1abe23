"""`spec.registration`: a succeeded job's exported model becomes one new MLflow model version (the edge; version.py
says when and with what tags).

Idempotent across operator restarts: the version is looked up by the job's run and UID tag before one is created,
so an operator killed between creating the version and writing status.registeredModel finds it again (one job,
one version). The alias (if any) is set after; setting it twice is harmless. Until it succeeds, the error is in
status.registeredModel.error and the next pass tries again.
"""

from __future__ import annotations

import logging

from ....core import client as kube
from ....core.events import post_events
from ....core.kit import Event, Manifest
from ....core.model import API_VERSION
from ....core.registry import Registry, RegistryError
from ..api import TrainingJobSpec, TrainingJobStatus
from .api import RegisteredModel
from .version import needs_registration, version_tags

log = logging.getLogger("loom.operator.trainingjob.register")


async def register_model(
    job: Manifest, spec: TrainingJobSpec, status: TrainingJobStatus
) -> tuple[RegisteredModel, list[Event]]:
    """Register (or find) the job's version and set its alias; the status field and the event to post."""
    assert spec.registration is not None and spec.tracking is not None and spec.tracking.mlflow is not None
    tracking_uri = spec.tracking.mlflow.tracking_uri
    name, alias = spec.registration.model, spec.registration.alias
    # Where the trainer exports the final model (the layout a server loads), as InferenceService's fromTrainingJob.
    source = f"{spec.checkpoint.uri.rstrip('/')}/final" if spec.checkpoint is not None else ""
    run_id = str(status.mlflow.run_id if status.mlflow else "")
    if tracking_uri is None:
        return RegisteredModel(name=name, alias=alias, error="no MLflow tracking URI"), []
    try:
        async with Registry(tracking_uri) as registry:
            await registry.ensure_model(name)
            version = await registry.find_run_version(name, run_id, str(job["metadata"]["uid"]))
            if version is None:
                metrics = await registry.run_metrics(run_id)
                version = await registry.create_version(
                    name, source=source, run_id=run_id, tags=version_tags(job, spec, status, metrics),
                    description=f"trained by TrainingJob {job['metadata']['namespace']}/{job['metadata']['name']}",
                )  # fmt: skip
            if alias is not None:
                await registry.set_alias(name, alias, version.version)
    except RegistryError as error:
        log.warning("registering %s for %s: %s", name, job["metadata"]["name"], error)
        return RegisteredModel(name=name, alias=alias, source=source, error=str(error)[:500]), []
    where = f" with alias {alias}" if alias else ""
    event = Event("Normal", "ModelRegistered", f"registered {source} as {name} version {version.version}{where}")
    return RegisteredModel(name=name, version=version.version, alias=alias, source=source), [event]


async def register_when_due(job: Manifest, spec: TrainingJobSpec, status: TrainingJobStatus) -> None:
    """A succeeded job's model registered (once): the outcome goes into status.registeredModel by a patch of its
    own (the pass wrote the job's status before), with the event that announces it."""
    if not needs_registration(spec, status):
        return
    registered, events = await register_model(job, spec, status)
    if registered != status.registered_model:
        meta = job["metadata"]
        patch = {"registeredModel": registered.to_wire()}
        await kube.patch_status(API_VERSION, "TrainingJob", meta["namespace"], meta["name"], patch)
    post_events(job, events)
