"""The activator's configuration: the contract between the operator and the activator pod.

The operator renders an ``ActivatorConfig`` as JSON into the pod's ``LOOM_ACTIVATOR_CONFIG`` variable (a change
of it is a new pod template, so the Deployment rolls it out). Pydantic only: the operator imports this module.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from loom.workloads.common.config import WorkloadConfig, label_selector

ENV_VAR = "LOOM_ACTIVATOR_CONFIG"
# Bounds of what an operator may configure (its settings activatorTimeoutS and activatorMaxHeld are declared with
# these); the defaults are what a service gets when nothing is set.
HoldSeconds = Annotated[float, Field(gt=0, le=3600)]
MaxHeld = Annotated[int, Field(ge=1, le=100_000)]
DEFAULT_TIMEOUT_SECONDS = 120.0
DEFAULT_MAX_HELD = 1000
DEFAULT_RETRY_AFTER_SECONDS = 5
DEFAULT_MAX_HELD_BYTES = 64 * 1024 * 1024


class ActivatorConfig(WorkloadConfig):
    """Everything the activator needs to hold, wake and forward for one InferenceService."""

    namespace: str = Field(min_length=1, description="Namespace of the InferenceService (and its pods).")
    service: str = Field(min_length=1, description="Name of the InferenceService woken through its scale path.")
    api_version: str = Field("loom.dev/v1alpha1", description="apiVersion of the InferenceService kind.")
    plural: str = Field("inferenceservices")
    pod_selector: dict[str, str] = Field(min_length=1, description="Labels of the model-server pods.")
    target_port: int = Field(8080, ge=1, le=65535, description="The model server's port on its pod.")
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=1, le=65535, description="Where the activator takes requests (the Service's).")
    admin_port: int = Field(9090, ge=1, le=65535, description="/healthz and /metrics (never proxied).")
    timeout_seconds: HoldSeconds = Field(
        DEFAULT_TIMEOUT_SECONDS, description="Longest a request is held; then 503 + Retry-After."
    )
    max_held: MaxHeld = Field(DEFAULT_MAX_HELD, description="Held requests beyond this get 503.")
    max_held_bytes: int = Field(
        DEFAULT_MAX_HELD_BYTES, ge=1024, description="Held request bytes beyond this get 503; a larger body 413."
    )
    retry_after_seconds: int = Field(DEFAULT_RETRY_AFTER_SECONDS, ge=1, le=3600)
    log_level: str = "info"

    def selector_string(self) -> str:
        return label_selector(self.pod_selector)
