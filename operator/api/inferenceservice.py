"""InferenceService: a model server that batches, streams, protects itself, rolls out safely and autoscales.

Fields the model server also reads take their limits, defaults and handler names from the server's own config
model (loom.workloads.server.config): one definition, checked by tests/unit/test_contracts.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loom.workloads.server import config as server

from .common import (
    ApiModel,
    DnsName,
    EnvVar,
    Quantity,
    ResourceRequirements,
    S3Credentials,
    SecretKeySelector,
    StatusBase,
    Toleration,
    cel,
    validations,
)
from .inferenceservice_vllm import VllmSpec

ServingPhase = Literal["Pending", "Loading", "Ready", "RollingOut", "Degraded", "Failed"]


class FromTrainingJob(ApiModel):
    """Serve what a TrainingJob in the same namespace produced; a newer checkpoint rolls out by itself."""

    name: DnsName = Field(description="TrainingJob name.")
    checkpoint: Literal["latest", "final"] = Field(
        "latest", description="latest: follow every new checkpoint; final: only the one written on success."
    )


class ModelSource(ApiModel):
    """Where the model comes from. It is fetched at boot into a cache volume, never baked into the image."""

    model_config = validations(
        cel(
            "[has(self.uri), has(self.mlflow), has(self.fromTrainingJob)].filter(x, x).size() == 1",
            "set exactly one of uri, mlflow or fromTrainingJob",
        ),
    )

    name: DnsName | None = Field(None, description="Model name in the inference protocol (default: object name).")
    uri: str | None = Field(
        None, description="s3://bucket/prefix of a model folder.", pattern=r"^s3://.+", max_length=1024
    )
    mlflow: str | None = Field(
        None,
        description="MLflow registry URI: models:/name/version or models:/name@alias (resolved version in status).",
        pattern=r"^models:/[^/@]+(/[0-9]+|@[A-Za-z0-9_\-]+)$",
        max_length=512,
    )
    from_training_job: FromTrainingJob | None = None
    version: str | None = Field(
        None,
        description="Version label the server reports and status shows (default: the MLflow version, the "
        "checkpoint step, or the last path segment of the uri).",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
        max_length=63,
    )
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URL for mlflow sources (default: the operator's, defaults.mlflow.trackingUri).",
        max_length=1024,
    )
    endpoint: str | None = Field(
        None, description="S3 endpoint URL for non-AWS stores (default: the operator's, defaults.s3.endpoint).",
        max_length=1024,
    )
    secret_ref: S3Credentials | None = Field(
        None, description="Secret with S3 credentials for fetching (default: the operator's, defaults.s3.secretName)."
    )


class ScalingPolicy(ApiModel):
    """At most `value` pods, or `value` percent of the replicas at the period's start, per period (as an HPA)."""

    type: Literal["Pods", "Percent"]
    value: int = Field(gt=0, le=10000)
    period_seconds: int = Field(gt=0, le=1800, description="How far back changes count against this policy.")


class ScalingRules(ApiModel):
    """One direction's behaviour, as autoscaling/v2 HPAScalingRules: a stabilization window and rate limits."""

    stabilization_window_seconds: int | None = Field(
        None,
        ge=0,
        le=3600,
        description="Act on the least extreme recommendation of this many seconds (default: 0 up, 300 down).",
    )
    policies: list[ScalingPolicy] | None = Field(
        None,
        min_length=1,
        max_length=10,
        description="Rate limits (default: up 4 pods or 100% per 15s, the larger; down 100% per 15s).",
    )
    select_policy: Literal["Max", "Min", "Disabled"] = Field(
        "Max", description="Max: the policy allowing the biggest change wins; Min: the smallest; Disabled: never."
    )


AutoscalingMetric = Literal[
    "gpu-utilization", "gpu-memory", "queue-depth", "concurrency", "requests-per-second", "prometheus",
    "llm-waiting-requests", "llm-kv-cache-usage", "llm-ttft-p95",
]


class Autoscaling(ApiModel):
    """Scale replicas on a metric read from Prometheus (the HPA algorithm); stabilization windows and rate limits
    keep it from flapping, and missing or stale metrics hold the replicas (never scale down).

    With engine builtin (and keda/hpa) the replica count is written through the scale subresource
    (spec.replicas), as an HPA does: leave spec.replicas out of what GitOps applies.
    """

    model_config = validations(
        cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas", field_path=".minReplicas"),
        cel(
            "self.metric == 'prometheus' ? has(self.query) : !has(self.query)",
            "query is required for metric prometheus and only allowed with it",
            field_path=".query",
        ),
        cel(
            "!has(self.idleSeconds) || self.minReplicas == 0",
            "idleSeconds needs minReplicas 0 (scale to zero)",
            field_path=".idleSeconds",
        ),
    )

    min_replicas: int = Field(1, ge=0, le=1000, description="Fewest replicas (0 allows scale to zero).")
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas.")
    metric: AutoscalingMetric = Field(
        "concurrency",
        description="What drives scaling: gpu-utilization and gpu-memory (percent, dcgm-exporter series), "
        "queue-depth and concurrency (requests per replica), requests-per-second (per replica), prometheus "
        "(the user's query: one number for the whole service), or for runtime vllm llm-waiting-requests "
        "(requests the engine queues), llm-kv-cache-usage (percent of the KV cache in use) and llm-ttft-p95 "
        "(seconds to the first token, 95th percentile).",
    )
    query: str | None = Field(
        None, min_length=1, max_length=4096, description="PromQL for metric prometheus (a vector is summed)."
    )
    target: float = Field(gt=0, description="Per-replica target of the metric (percent for GPU metrics).")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while |value / target - 1| <= tolerance.")
    scale_up: ScalingRules | None = Field(None, description="Scale-up window and rate limits.")
    scale_down: ScalingRules | None = Field(None, description="Scale-down window and rate limits.")
    idle_seconds: int | None = Field(
        None, ge=1, le=86400, description="With minReplicas 0: no activity for this long scales to zero (300)."
    )
    metric_max_age_seconds: int = Field(
        60, ge=1, le=3600, description="Older samples are stale: the replicas hold and MetricsAvailable is False."
    )
    engine: Literal["builtin", "keda", "hpa"] = Field(
        "builtin", description="Who scales: Loom itself, KEDA, or an HPA."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Autoscaling:
        # The same rules as the CEL above, for objects that never went through admission (tests, renders).
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})")
        if (self.metric == "prometheus") != (self.query is not None):
            raise ValueError("query is required for metric prometheus and only allowed with it")
        if self.idle_seconds is not None and self.min_replicas != 0:
            raise ValueError("idleSeconds needs minReplicas 0 (scale to zero)")
        return self


class Batching(ApiModel):
    """Adaptive batching: requests wait until maxBatchSize are pooled or maxLatencyMs passed."""

    max_batch_size: server.MaxBatchSize = Field(
        server.DEFAULT_MAX_BATCH_SIZE, description="Most requests run in one predict call."
    )
    max_latency_ms: server.MaxLatencyMs = Field(
        server.DEFAULT_MAX_LATENCY_MS, description="Longest a request waits for others to join its batch."
    )
    max_queue: server.MaxQueue = Field(server.DEFAULT_MAX_QUEUE, description="Requests waiting beyond this get 503.")


class RateLimit(ApiModel):
    requests_per_second: server.RequestsPerSecond = Field(description="Token refill rate per API key.")
    burst: server.Burst = Field(server.DEFAULT_BURST, description="Bucket size per API key.")


class Auth(ApiModel):
    """API keys from a Secret (one key per line) and per-key rate limits."""

    api_keys_secret_ref: SecretKeySelector = Field(description="Secret key holding API keys, one per line.")
    rate_limit: RateLimit | None = None


class Rollout(ApiModel):
    """Rolling update and canary settings."""

    max_surge: Quantity | None = Field(
        None, description="Default: 25% on CPU, 0 when GPUs are requested (no spare GPU is assumed)."
    )
    max_unavailable: Quantity | None = Field(None, description="Default: 0 on CPU, 1 when GPUs are requested.")
    canary_percent: int | None = Field(
        None,
        ge=0,
        le=100,
        description="Share of traffic for a new model version, approximated by replica counts (at least one canary "
        "replica); unset or 100 promotes it, setting the model back to the stable one rolls back.",
    )
    min_ready_seconds: int = Field(
        5, ge=0, le=3600, description="A new replica counts as available only after being ready this long."
    )


class FeatureEnrichment(ApiModel):
    feature_view: DnsName = Field(description="FeatureView whose online features enrich requests.")
    entity_keys: list[str] = Field(min_length=1, max_length=16, description="Request inputs used as entity keys.")


class InferenceServiceSpec(ApiModel):
    model_config = validations(
        cel("self.runtime == 'vllm' || !has(self.vllm)", "vllm options need runtime: vllm", field_path=".vllm"),
        cel("self.runtime != 'vllm' || !has(self.features)", "runtime vllm takes no feature enrichment",
            field_path=".features"),
        cel("self.runtime == 'vllm' || !has(self.autoscaling) || !self.autoscaling.metric.startsWith('llm-')",
            "llm-* autoscaling metrics need runtime: vllm", field_path=".autoscaling.metric"),
    )

    model: ModelSource
    runtime: Literal["default", "vllm"] = Field(
        "default",
        description="default: Loom's model server (OIP v2, the handlers); vllm: the vLLM engine behind Loom's "
        "OpenAI-compatible front (the model is a Hugging Face-format folder).",
    )
    vllm: VllmSpec | None = Field(None, description="vLLM engine options and LLM limits (runtime vllm).")
    handler: str = Field(
        "auto",
        description=f"How to load and call the model: {' | '.join(server.BUILTIN_HANDLERS)} | "
        "'module:Class' | auto (guessed from the model folder).",
        max_length=256,
    )
    image: str | None = Field(None, description="Server image (default: the operator's server image).")
    replicas: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Replica count (default 1). With autoscaling it is the autoscaler's (the scale subresource "
        "writes it, kept within min/maxReplicas): leave it out of manifests.",
    )
    autoscaling: Autoscaling | None = None
    gpus: int = Field(0, ge=0, le=16, description="nvidia.com/gpu per replica.")
    resources: ResourceRequirements | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = Field(None, max_length=32)
    env: list[EnvVar] | None = Field(None, max_length=128)
    batching: Batching = Field(default_factory=Batching)
    auth: Auth | None = None
    rollout: Rollout = Field(default_factory=Rollout)
    features: FeatureEnrichment | None = None
    cache_size_limit: Quantity = Field("10Gi", description="Size limit of the model cache volume.")

    @property
    def serving_handler(self) -> str:
        """The handler the fetch step's config names: the vllm runtime loads no handler (noop keeps it valid)."""
        return "noop" if self.runtime == "vllm" else self.handler


class CanaryStatus(ApiModel):
    percent: int = Field(0, description="Share of traffic asked for (canaryPercent).")
    model_version: str | None = None
    replicas: int = Field(0, description="Canary replicas; the traffic share is replicas / all replicas.")
    ready_replicas: int = 0


class AutoscalingStatus(ApiModel):
    """The autoscaler's last look: the metric it saw, what it wants, and its last change."""

    metric: str | None = Field(None, description="The metric scaled on.")
    current_replicas: int | None = Field(None, description="Replicas asked for when it last decided.")
    desired_replicas: int | None = Field(None, description="Replicas it wants now.")
    metric_value: float | None = Field(
        None, description="Metric value seen (per replica; the whole service's for metric prometheus)."
    )
    metric_timestamp: str | None = Field(None, description="When that value was sampled (RFC 3339).")
    last_scale_time: str | None = Field(None, description="When it last changed the replicas (RFC 3339).")
    last_scale_reason: str | None = Field(None, description="Why, e.g. ScaledUp, ScaledDown, ScaledToZero.")
    last_scale_message: str | None = None


class InferenceServiceStatus(StatusBase):
    phase: ServingPhase | None = None
    url: str | None = None
    openai_base_url: str | None = Field(None, description="Base URL of the OpenAI-compatible API (runtime vllm).")
    replicas: int = Field(0, description="Replicas running (scale subresource).")
    ready_replicas: int = 0
    selector: str | None = Field(None, description="Label selector of the serving pods (scale subresource).")
    model_version: str | None = Field(None, description="Model version being served to stable traffic.")
    canary: CanaryStatus | None = None
    autoscaling: AutoscalingStatus | None = None


class InferenceService(ApiModel):
    """A model served over the Open Inference Protocol (v2), with batching, streaming, auth and autoscaling."""

    api_version: Literal["loom.dev/v1alpha1"] = "loom.dev/v1alpha1"
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
