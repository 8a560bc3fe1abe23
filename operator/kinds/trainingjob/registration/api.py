"""spec.register and status.registeredModel of a TrainingJob: its export as a new MLflow model version (io.py)."""

from __future__ import annotations

from pydantic import Field

from ....core.model import ApiModel


class Register(ApiModel):
    """Register the job's exported model (<checkpoint.uri>/final) as a new version of an MLflow registered model
    once the job succeeded: one job, one version, tagged with the run, the final metrics, the checkpoint URI and
    the job's name; optionally an alias (e.g. challenger) is moved to it."""

    model: str = Field(
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="Registered model name."
    )
    alias: str | None = Field(
        None, max_length=255, pattern=r"^[A-Za-z0-9_\-]+$", description="Alias set to the new version."
    )
    tags: dict[str, str] | None = Field(None, max_length=32, description="Extra version tags.")


class RegisteredModel(ApiModel):
    name: str
    version: str | None = Field(None, description="The model version this job registered.")
    alias: str | None = None
    source: str | None = Field(None, description="The registered artifact (the final export).")
    error: str | None = Field(None, description="Why registration has not happened yet (retried).")
