"""`spec.registration`: whether a job's model is due for registration, and the tags its MLflow version gets (pure)."""

from __future__ import annotations

from ....core.kit import Manifest
from ....core.model import JOB_UID_TAG
from ..api import TrainingJobSpec, TrainingJobStatus


def needs_registration(spec: TrainingJobSpec, status: TrainingJobStatus) -> bool:
    done = status.registered_model is not None and status.registered_model.version is not None
    run = status.mlflow.run_id if status.mlflow else None
    return spec.registration is not None and status.phase == "Succeeded" and not done and run is not None


def version_tags(
    job: Manifest, spec: TrainingJobSpec, status: TrainingJobStatus, metrics: dict[str, float]
) -> dict[str, str]:
    meta = job["metadata"]
    tags = {
        JOB_UID_TAG: str(meta["uid"]),
        "loom.dev/trainingjob": f"{meta['namespace']}/{meta['name']}",
        "loom.dev/run-id": str(status.mlflow.run_id if status.mlflow else ""),
    }
    if status.checkpoint is not None and status.checkpoint.latest:
        tags["loom.dev/checkpoint"] = status.checkpoint.latest
    if status.checkpoint is not None and status.checkpoint.step is not None:
        tags["loom.dev/step"] = str(status.checkpoint.step)
    tags.update({f"metric.{key}": f"{value:.6g}" for key, value in sorted(metrics.items())[:64]})
    if spec.registration is not None and spec.registration.tags:
        tags.update(spec.registration.tags)
    return tags
