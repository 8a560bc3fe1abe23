"""InferenceService: a model server that batches, streams, protects itself, rolls out safely and autoscales.

Fields the model server also reads take their limits, defaults and handler names from the server's own config
model (loom.workloads.server.config): one definition, checked by tests/unit/test_contracts.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loom.workloads.server import config as server

from ...autoscale.spec import (  # re-exported: the SDK and the tests name them here
    Autoscaling,
    AutoscalingStatus,
)
from ...core.kind import AGE, PHASE, Kind, NameRule, PrinterColumn
from ...core.model import (
    ApiModel,
    EnvVar,
    IntOrPercent,
    Quantity,
    ResourceRequirements,
    SecretKeySelector,
    StatusBase,
    Toleration,
    cel,
    validations,
)
from .canary.api import Analysis, RolloutStatus
from .enrichment.api import FeatureEnrichment
from .llm.api import Adapter, AdapterStatus, DisaggregationStatus, VllmSpec
from .queue.api import ServiceQueueStatus
from .source.api import AliasStatus, ModelSource
from .traffic.api import Routing

# A root rule's first term: the service is not disaggregated (the rest of the rule holds only when it is).
_SPLIT = "!has(self.vllm) || !has(self.vllm.disaggregation)"

ServingPhase = Literal["Pending", "Loading", "Ready", "RollingOut", "Degraded", "Failed"]


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
    """Rolling update and canary settings: a fixed canaryPercent a person promotes, or an analysis that walks the
    canary through steps and promotes or rolls it back by itself."""

    model_config = validations(
        cel("!has(self.canaryPercent) || !has(self.analysis)", "set canaryPercent or analysis, not both",
            field_path=".analysis"),
    )  # fmt: skip

    max_surge: IntOrPercent | None = Field(
        None, description="Default: 25% on CPU, 0 when GPUs are requested (no spare GPU is assumed)."
    )
    max_unavailable: IntOrPercent | None = Field(None, description="Default: 0 on CPU, 1 when GPUs are requested.")
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
    analysis: Analysis | None = Field(
        None, description="Automated canary analysis: a new model version walks these steps, judged by checks on "
        "Prometheus metrics against the stable version, and is promoted or rolled back by itself."
    )


class InferenceServiceSpec(ApiModel):
    model_config = validations(
        cel("self.runtime == 'vllm' || !has(self.vllm)", "vllm options need runtime: vllm", field_path=".vllm"),
        cel("self.runtime != 'vllm' || !has(self.features)", "runtime vllm takes no feature enrichment",
            field_path=".features"),
        cel("self.runtime == 'vllm' || !has(self.autoscaling) || !self.autoscaling.metric.startsWith('llm-')",
            "llm-* autoscaling metrics need runtime: vllm", field_path=".autoscaling.metric"),
        cel("self.runtime == 'vllm' || !has(self.routing)", "routing needs runtime: vllm", field_path=".routing"),
        cel("self.runtime == 'vllm' || !has(self.adapters)", "adapters need runtime: vllm", field_path=".adapters"),
        # Loom renders the engine's KV-events flag for the picker (llm/vllm.py): a second one would replace it.
        cel("!has(self.routing) || !has(self.routing.prefixMatch) || self.routing.prefixMatch != 'events' || "
            "!has(self.vllm) || !has(self.vllm.extraArgs) || "
            "!self.vllm.extraArgs.exists(a, a.startsWith('--kv-events-config'))",
            "routing.prefixMatch events sets --kv-events-config itself: remove it from vllm.extraArgs",
            field_path=".vllm.extraArgs"),
        # The message names a duplicate. It is built inside map(), from the list's own items: the API server's cost
        # estimate loses the names' maxLength on what filter() returns, and a string added to one is over budget.
        cel("!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
            "adapter names must be unique", field_path=".adapters",
            message_expression="self.adapters.map(a, self.adapters.exists_one(b, b.name == a.name) ? '' : "
                               "'adapter names must be unique: ' + a.name + ' appears more than once')"
                               ".filter(m, m != '')[0]"),
        # The base model's default name is the object's, which only a root rule may read: llm/adapters.py
        # `name_problem` reports that clash in status.
        cel("!has(self.adapters) || !has(self.model.name) || !self.adapters.exists(a, a.name == self.model.name)",
            "an adapter may not take the base model's name (model.name)", field_path=".adapters"),

        # vllm.disaggregation (llm/disaggregation.py): each pool has its replicas; what is not built for two pools
        # is refused here rather than half done.
        cel(f"{_SPLIT} || !has(self.replicas)",
            "with vllm.disaggregation, set vllm.disaggregation.prefill.replicas and decode.replicas, not replicas",
            field_path=".replicas"),
        cel(f"{_SPLIT} || !has(self.autoscaling)",
            "autoscaling is not supported with vllm.disaggregation yet: set each pool's replicas",
            field_path=".autoscaling"),
        cel(f"{_SPLIT} || !has(self.rollout) || (!has(self.rollout.canaryPercent) && !has(self.rollout.analysis))",
            "a canary (rollout.canaryPercent, rollout.analysis) is not supported with vllm.disaggregation yet: a new "
            "model rolls both pools", field_path=".rollout"),
        cel(f"{_SPLIT} || !has(self.adapters)",
            "adapters are not supported with vllm.disaggregation: the SharedStorage connector keys a KV cache by the "
            "prompt's tokens alone, so an adapter's would be handed to the base model's requests",
            field_path=".adapters"),
        cel(f"{_SPLIT} || !has(self.routing) || !has(self.routing.inferencePool)",
            "routing.inferencePool is not supported with vllm.disaggregation: a gateway sends a request to one "
            "endpoint, prefill and decode need two (Loom's picker makes both calls)",
            field_path=".routing.inferencePool"),
    )

    model: ModelSource
    runtime: Literal["default", "vllm"] = Field(
        "default",
        description="default: Loom's model server (OIP v2, the handlers); vllm: the vLLM engine behind Loom's "
        "OpenAI-compatible front (the model is a Hugging Face-format folder).",
    )
    vllm: VllmSpec | None = Field(None, description="vLLM engine options and LLM limits (runtime vllm).")
    routing: Routing | None = Field(None, description="How requests spread over the replicas (runtime vllm; "
                                    "default prefix-cache when it may run more than one replica).")
    adapters: list[Adapter] | None = Field(
        None, max_length=64,
        description="LoRA adapters served beside the model (runtime vllm), each selected by its name as the "
        "OpenAI `model`. Changing the list loads and unloads adapters in the running replicas, no restart; going "
        "from no `adapters` field to one restarts them once (the engine starts with LoRA on): `adapters: []` "
        "turns LoRA on with none loaded. vllm.maxLoadedAdapters bounds the adapters held per replica at once.",
    )
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
    resources: ResourceRequirements | None = Field(
        None,
        description="CPU/memory of the model server (and its fetch step). With the default runtime, its CPU limit "
        "(else request, else 1) also sets OMP_NUM_THREADS, PyTorch's CPU threads, unless env names it.",
    )
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


class InferenceServiceStatus(StatusBase):
    phase: ServingPhase | None = None
    url: str | None = None
    openai_base_url: str | None = Field(None, description="Base URL of the OpenAI-compatible API (runtime vllm).")
    replicas: int = Field(0, description="Replicas running (scale subresource).")
    ready_replicas: int = 0
    selector: str | None = Field(None, description="Label selector of the serving pods (scale subresource).")
    model_version: str | None = Field(None, description="Model version being served to stable traffic.")
    model_image: str | None = Field(
        None, description="For model.uri oci://: the image stable traffic is served from, by digest (a tag resolved)."
    )
    canary: CanaryStatus | None = None
    rollout: RolloutStatus | None = Field(None, description="Canary analysis: its step, verdict and rejected versions.")
    model_changed: str | None = Field(None, description="Why the model asked for last changed.")
    alias: AliasStatus | None = Field(None, description="The followed MLflow alias (model.mlflow: models:/name@alias).")
    autoscaling: AutoscalingStatus | None = None
    queue: ServiceQueueStatus | None = Field(None, description="Admission by Kueue (label kueue.x-k8s.io/queue-name).")
    adapters: list[AdapterStatus] | None = Field(None, description="spec.adapters, each with its state per replica.")
    inference_pool: str | None = Field(None, description="The InferencePool (inference.networking.k8s.io/v1) this "
                                       "service made for spec.routing.inferencePool: an HTTPRoute's backendRef.")
    disaggregation: DisaggregationStatus | None = Field(
        None, description="spec.vllm.disaggregation: the prefill and decode pools' replicas.")


class InferenceService(ApiModel):
    """A model served over the Open Inference Protocol (v2), with batching, streaming, auth and autoscaling."""

    api_version: Literal["loom.dev/v1alpha1"] = "loom.dev/v1alpha1"
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None


# The kind as Kubernetes shows it (the CRD's names, columns and name rule; api/kinds.py lists every kind).
INFERENCE_SERVICE = Kind(
    kind="InferenceService",
    plural="inferenceservices",
    singular="inferenceservice",
    short_names=("lis",),
    model=InferenceService,
    spec=InferenceServiceSpec,
    status=InferenceServiceStatus,
    columns=(
        PrinterColumn("URL", ".status.url"),
        PHASE,
        PrinterColumn("Ready", ".status.readyReplicas", "integer"),
        PrinterColumn("Replicas", ".status.replicas", "integer"),
        PrinterColumn("Runtime", ".spec.runtime"),
        PrinterColumn("Model", ".spec.model.name", priority=1),
        PrinterColumn("Version", ".status.modelVersion"),
        PrinterColumn("Canary", ".status.canary.percent", "integer"),
        PrinterColumn("Step", ".status.rollout.analysis.step"),
        PrinterColumn("Verdict", ".status.rollout.analysis.verdict"),
        PrinterColumn("Desired", ".status.autoscaling.desiredReplicas", "integer", description="Autoscaler wants"),
        PrinterColumn("Metric", ".status.autoscaling.metricValue", "number", priority=1),
        PrinterColumn("Scaled", ".status.autoscaling.lastScaleReason", priority=1),
        PrinterColumn("OpenAI", ".status.openaiBaseUrl", priority=1),
        PrinterColumn("Pool", ".status.inferencePool", priority=1, description="Its InferencePool (GIE)"),
        PrinterColumn("Prefill", ".status.disaggregation.prefill.readyReplicas", "integer", priority=1,
                      description="Ready prefill replicas (vllm.disaggregation)"),
        PrinterColumn("Decode", ".status.disaggregation.decode.readyReplicas", "integer", priority=1,
                      description="Ready decode replicas (vllm.disaggregation)"),
        # The Ready condition's own words: why it is not (a replica's own fatal error, issue 52), or what serves.
        PrinterColumn("Message", '.status.conditions[?(@.type=="Ready")].message', priority=1),
        PrinterColumn("Admission", ".status.queue.state", priority=1, description="Kueue: Queued, Admitted, Evicting"),
        PrinterColumn("Admitted", ".status.queue.admittedReplicas", "integer", priority=1, description="By Kueue"),
        PrinterColumn("Flavor", ".status.queue.flavor", priority=1, description="Kueue ResourceFlavor admitted"),
        PrinterColumn("Position", ".status.queue.position", "integer", priority=1, description="Place in the queue"),
        AGE,
    ),
    name_rule=NameRule(
        53, dns_label=True, why="its Service is <name> and its scale-to-zero activator's Service <name>-activator"
    ),
    scale=True,
)
