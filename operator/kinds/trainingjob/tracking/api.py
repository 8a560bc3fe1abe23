"""spec.tracking and status.mlflow of a TrainingJob: the MLflow run the operator creates before the workers start."""

from __future__ import annotations

from pydantic import Field

from loom.workloads.trainer import config as trainer

from ....core.model import ApiModel


class MlflowTracking(ApiModel):
    """MLflow tracking: the operator creates the run before the pods start, so retries log to one run."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server URL (default: the operator's, chart value defaults.mlflow.trackingUri).",
        max_length=1024,
    )
    experiment: str = Field(trainer.DEFAULT_MLFLOW_EXPERIMENT, description="Experiment name.", max_length=256)


class Tracking(ApiModel):
    mlflow: MlflowTracking | None = None


class MlflowRun(ApiModel):
    run_id: str | None = None
    url: str | None = None
