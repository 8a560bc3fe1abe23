"""The model server's configuration: the contract between the operator and the server pod.

The operator renders a ``ServerConfig`` into the server's ConfigMap (JSON, camelCase) and the
server reads it back with :meth:`ServerConfig.from_file`. This module imports pydantic only, so the
operator can use it without torch, starlette or boto3 installed.

Secrets never travel through this object: API keys are named by the path of a mounted Secret file
(or an environment variable), S3 and MLflow credentials come from the pod's environment.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from loom.workloads.common.body_limit import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT_S
from loom.workloads.common.config import CamelModel, WorkloadConfig
from loom.workloads.common.model_name import ModelName

# Handlers that ship with the server, by name -> the "module:Class" that implements it (imported only when
# chosen, by handlers.load_handler_class, so this module stays free of torch). The one list of handler names:
# the server, the operator's API description and its 'auto' resolution all read it. Anything else must be
# "package.module:ClassName".
BUILTIN_HANDLER_CLASSES: dict[str, str] = {
    "chargpt": "loom.workloads.server.chargpt_handler:CharGPTModel",
    "torchscript": "loom.workloads.server.handlers:TorchScriptModel",
    "torch-export": "loom.workloads.server.handlers:TorchExportModel",
    "mlflow-pyfunc": "loom.workloads.server.handlers:MLflowPyfuncModel",
    "noop": "loom.workloads.server.handlers:NoopModel",
}
BUILTIN_HANDLERS: tuple[str, ...] = tuple(BUILTIN_HANDLER_CLASSES)
_CUSTOM_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# models:/name/3, models:/name@champion, models:/name/latest
_MLFLOW_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>[^/@]+)|@(?P<alias>[^/@]+))$")

StorageKind = Literal["auto", "s3", "mlflow", "checkpoint", "local"]

# ------------------------------------------------------------------------------------------- shared vocabulary
# Every limit and default that an InferenceService also exposes is written here, once; the operator's API
# (loom.operator.api.inferenceservice) imports them, and tests/unit/test_contracts.py fails if the two drift apart.
MaxBatchSize = Annotated[int, Field(ge=1, le=4096)]
MaxLatencyMs = Annotated[float, Field(ge=0, le=60_000)]
MaxQueue = Annotated[int, Field(ge=1, le=1_000_000)]
RequestsPerSecond = Annotated[float, Field(gt=0, le=1_000_000)]
Burst = Annotated[int, Field(ge=1, le=1_000_000)]

DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_LATENCY_MS = 10.0
DEFAULT_MAX_QUEUE = 256
DEFAULT_BURST = 10


class BatchingConfig(CamelModel):
    """Adaptive batching: pool requests until ``max_batch_size`` or ``max_latency_ms``."""

    max_batch_size: MaxBatchSize = Field(DEFAULT_MAX_BATCH_SIZE, description="Most requests run in one predict call.")
    max_latency_ms: MaxLatencyMs = Field(
        DEFAULT_MAX_LATENCY_MS, description="Longest a request waits for others to join its batch."
    )
    max_queue: MaxQueue = Field(DEFAULT_MAX_QUEUE, description="Requests waiting beyond this are refused with 503.")


class RateLimitConfig(CamelModel):
    """Per-key limit: ``burst`` requests at once, ``requests_per_second`` sustained."""

    requests_per_second: RequestsPerSecond
    burst: Burst = DEFAULT_BURST


class AuthConfig(CamelModel):
    """API keys and rate limits. Keys are read from a mounted Secret file or an env variable."""

    api_keys_file: str | None = Field(
        None, description="File with one API key per line (a mounted Secret); '#' starts a comment."
    )
    api_keys_env: str | None = Field(
        None, description="Environment variable holding comma-separated API keys."
    )
    rate_limit: RateLimitConfig | None = None

    @property
    def enabled(self) -> bool:
        return self.api_keys_file is not None or self.api_keys_env is not None


# Feature enrichment (InferenceService spec.features). The operator resolves the FeatureView into the Feast view
# name, its features and the project's feature server URL; entityKeys are the view's join keys, read from the request.
EntityKeys = Annotated[list[str], Field(min_length=1, max_length=16)]
DEFAULT_ENRICHMENT_TIMEOUT_MS = 2000.0
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnrichedFeature(CamelModel):
    """One online feature the server adds to each request, with its Feast dtype (which fixes the tensor's)."""

    name: str
    dtype: str = Field(description="A Feast dtype: Int64, Float32, String, Array(Float32), ...")

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError(f"feature name {value!r} must be an identifier (letters, digits, '_')")
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        # The one list of Feast dtypes (pydantic-only module, as this one).
        from loom.workloads.features.config import FEATURE_DTYPES

        if value not in FEATURE_DTYPES:
            raise ValueError(f"unknown Feast dtype {value!r} (supported: {', '.join(FEATURE_DTYPES)})")
        return value


class EnrichmentConfig(CamelModel):
    """Enrich each infer request with one entity's online features from a Feast feature server (enrichment.py)."""

    url: str = Field(
        description="Feast feature server base URL (POST {url}/get-online-features).", pattern=r"^https?://.+"
    )
    feature_view: str = Field(description="Feast feature view name (the FeatureView's name with '-' as '_').")
    features: list[EnrichedFeature] = Field(min_length=1, max_length=256)
    entity_keys: EntityKeys = Field(description="Join keys, read from the request's inputs or parameters.")
    timeout_ms: float = Field(DEFAULT_ENRICHMENT_TIMEOUT_MS, gt=0, le=60_000, description="Per feature server call.")
    connect_retries: int = Field(2, ge=0, le=10, description="Retries of a call that could not connect.")

    @field_validator("feature_view")
    @classmethod
    def _view(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError(f"featureView {value!r} must be a Feast view name (letters, digits, '_')")
        return value


class ServerConfig(WorkloadConfig):
    """Everything the model server needs to fetch, load and serve one model."""

    json_indent: ClassVar[int | None] = 2

    model_name: ModelName = Field(description="Name clients use in /v2/models/{name}.")
    model_version: str | None = Field(
        None, description="Version served; for MLflow URIs the fetch step records the resolved one."
    )
    handler: str = Field("noop", description=f"One of {', '.join(BUILTIN_HANDLERS)} or 'module:Class'.")
    handler_options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the handler (e.g. device, dtype, maxNewTokens)."
    )
    model_dir: str = Field("/models", description="Cache volume the model is fetched into.")
    storage_uri: str | None = Field(
        None, description="s3://bucket/prefix, models:/name/version, models:/name@alias or a local path."
    )
    storage_kind: StorageKind = Field(
        "auto", description="'checkpoint' treats storageUri as a TrainingJob checkpoint root."
    )
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=1, le=65535)
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Separate metrics port; when unset /metrics is on the main port."
    )
    features: EnrichmentConfig | None = Field(
        None, description="Online features added to every infer request (from a FeatureView)."
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1024, description="Larger request bodies are refused with 413."
    )
    request_body_timeout_s: float = Field(
        DEFAULT_REQUEST_BODY_TIMEOUT_S, gt=0, le=3600, description="A body not received within this gets 408."
    )

    @field_validator("handler")
    @classmethod
    def _check_handler(cls, value: str) -> str:
        if value not in BUILTIN_HANDLERS and not _CUSTOM_HANDLER.match(value):
            raise ValueError(f"handler must be one of {', '.join(BUILTIN_HANDLERS)} or 'package.module:Class'")
        return value

    @model_validator(mode="after")
    def _check_storage(self) -> ServerConfig:
        if self.storage_uri is not None:
            kind = self.resolved_storage_kind
            if kind in ("s3", "checkpoint") and not self.storage_uri.startswith("s3://"):
                raise ValueError(f"storageKind {kind} needs an s3:// storageUri")
            if kind == "mlflow" and not _MLFLOW_URI.match(self.storage_uri):
                raise ValueError("MLflow storageUri must be models:/name/version or models:/name@alias")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError("metricsPort must differ from port (leave it unset to share the port)")
        return self

    @property
    def resolved_storage_kind(self) -> StorageKind:
        """The storage kind, with 'auto' decided by the URI's scheme."""
        if self.storage_kind != "auto":
            return self.storage_kind
        uri = self.storage_uri or ""
        if uri.startswith("models:/"):
            return "mlflow"
        if uri.startswith("s3://"):
            return "s3"
        return "local"


def parse_mlflow_uri(uri: str) -> tuple[str, str | None, str | None]:
    """Split models:/name/version or models:/name@alias into (name, version, alias)."""
    match = _MLFLOW_URI.match(uri)
    if match is None:
        raise ValueError(f"not an MLflow model URI: {uri!r}")
    return match["name"], match["version"], match["alias"]
