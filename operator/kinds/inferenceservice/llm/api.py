"""InferenceService spec.vllm, spec.adapters and status.adapters: the LLM runtime's API.

spec.vllm: the vLLM engine's options for `runtime: vllm`, typed with vLLM's defaults (unset: vLLM decides), plus
`extraArgs`, the documented passthrough of any other vllm flag. spec.adapters: LoRA adapters loaded into the running
engines; status.adapters: their state per replica, in the front's own words (AdapterState).

Limits and flag rules come from the runtime's own config model (loom.workloads.llm.config): one definition.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loom.workloads.llm.adapters import AdapterState
from loom.workloads.llm.config import (
    RESERVED_FLAGS,
    Dtype,
    EngineOptions,
    GpuMemoryUtilization,
    KvCacheMemoryBytes,
    LoraRank,
    MaxLoras,
    MaxModelLen,
    MaxNumSeqs,
    MaxTokensLimit,
    RequestsPerMinute,
    TokensPerMinute,
)

from ....core.model import ApiModel, DnsName, cel, validations

# Hyphens need no escape outside a character class (and CEL strings refuse "\\-").
_RESERVED_RE = "^(" + "|".join(RESERVED_FLAGS) + ")(=.*)?$"
# The flags spec.vllm.parallelism sets: with it, extraArgs may not set them too.
PARALLELISM_FLAGS = (
    "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--nnodes", "--node-rank",
    "--master-addr", "--master-port", "--headless", "--distributed-executor-backend", "--data-parallel-backend",
)  # fmt: skip
_PARALLELISM_RE = "^(" + "|".join(PARALLELISM_FLAGS) + ")(=.*)?$"
# The flags spec.vllm.disaggregation sets on both pools (the KV connector, and one-step prefills: see
# llm/disaggregation.py): with it, extraArgs may not set them too.
KV_TRANSFER_FLAG = "--kv-transfer-config"
NO_CHUNKED_PREFILL_FLAG = "--no-enable-chunked-prefill"
DISAGGREGATION_FLAGS = (KV_TRANSFER_FLAG, "--enable-chunked-prefill", NO_CHUNKED_PREFILL_FLAG)
_DISAGGREGATION_RE = "^(" + "|".join(DISAGGREGATION_FLAGS) + ")(=.*)?$"


class Parallelism(ApiModel):
    """How one replica's engine is spread: over tensor x pipeline x data parallel ranks, on podsPerReplica pods.
    With more than one pod, a replica is a LeaderWorkerSet group (the leader runs the OpenAI front and vLLM's rank 0;
    each worker runs vLLM headless with its share of the ranks), started, restarted on any member's loss and rolled
    out as one; replicas, readiness, autoscaling and Kueue's admission count groups."""

    model_config = validations(
        cel("(self.tensor * self.pipeline * self.data) % self.podsPerReplica == 0",
            "tensor x pipeline x data (the engine's ranks) must be divisible by podsPerReplica: each pod runs the "
            "same number of ranks"),
        cel("self.podsPerReplica <= self.tensor * self.pipeline * self.data",
            "podsPerReplica may not exceed tensor x pipeline x data: a pod would run no rank"),
    )  # fmt: skip

    tensor: Annotated[int, Field(ge=1, le=64)] = Field(1, description="vllm --tensor-parallel-size.")
    pipeline: Annotated[int, Field(ge=1, le=64)] = Field(1, description="vllm --pipeline-parallel-size.")
    data: Annotated[int, Field(ge=1, le=64)] = Field(1, description="vllm --data-parallel-size.")
    pods_per_replica: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Pods one replica runs on (vllm --nnodes). Each pod asks for spec.gpus and spec.resources, "
                       "so with GPUs, spec.gpus x podsPerReplica must equal tensor x pipeline x data.")

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


KvConnector = Literal["SharedStorage"]


class DisaggregationPool(ApiModel):
    """One pool of a disaggregated service: its replicas, each a pod running the same engine and front."""

    replicas: Annotated[int, Field(ge=1, le=1000)] = Field(
        1, description="Replicas of this pool (autoscaling a pool is not supported yet).")


class KvStorage(ApiModel):
    """Where the prefill pool leaves the KV cache it computed and the decode pool reads it."""

    claim_name: str = Field(
        description="A PersistentVolumeClaim of the service's namespace, ReadWriteMany (every pod of both pools "
                    "mounts it). The SharedStorage connector never deletes what it wrote: size it, or empty it, "
                    "for the prompts it will see.",
        min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class Disaggregation(ApiModel):
    """Prefill/decode disaggregation: a prefill pool computes each prompt's KV cache and hands it over, through the
    connector, to a decode pool that generates the tokens; the service's picker sends each request to a prefill
    replica and then to a decode replica of the same kv-version (same model and engine). A decode replica given a
    prompt whose KV cache was not handed over computes it itself, so a request is answered either way."""

    connector: KvConnector = Field(
        "SharedStorage", description="How the KV cache is handed over. SharedStorage: vLLM's ExampleConnector, "
        "block-aligned KV files in a folder both pools mount (kvStorage); runs on CPU and GPU, made for proofs "
        "and small loads rather than throughput.")
    kv_storage: KvStorage = Field(description="The shared folder of the SharedStorage connector.")
    prefill: DisaggregationPool = Field(default_factory=DisaggregationPool, description="The prefill pool.")
    decode: DisaggregationPool = Field(default_factory=DisaggregationPool, description="The decode pool.")


class VllmSpec(ApiModel):
    """vLLM engine options and the front's per-key LLM limits."""

    model_config = validations(
        # has(): the API server applies no default for a list the user left out, so the field may be absent.
        cel("!has(self.extraArgs) || self.extraArgs.all(a, a.matches('^--[a-z0-9][a-z0-9-]*(=.*)?$'))",
            "each extraArgs entry must be '--flag' or '--flag=value'", field_path=".extraArgs"),
        cel(f"!has(self.extraArgs) || !self.extraArgs.exists(a, a.matches('{_RESERVED_RE}'))",
            "extraArgs may not set " + ", ".join(RESERVED_FLAGS) + ": Loom sets them", field_path=".extraArgs"),
        cel("!has(self.parallelism) || !has(self.tensorParallelSize)",
            "set tensorParallelSize or parallelism.tensor, not both", field_path=".parallelism"),
        cel("!has(self.parallelism) || !has(self.extraArgs) || "
            f"!self.extraArgs.exists(a, a.matches('{_PARALLELISM_RE}'))",
            "with parallelism, extraArgs may not set " + ", ".join(PARALLELISM_FLAGS) + ": Loom sets them",
            field_path=".extraArgs"),
        cel("!has(self.disaggregation) || !has(self.parallelism)",
            "disaggregation with parallelism (a replica of several pods) is not supported yet",
            field_path=".disaggregation"),
        cel("!has(self.disaggregation) || !has(self.extraArgs) || "
            f"!self.extraArgs.exists(a, a.matches('{_DISAGGREGATION_RE}'))",
            "with disaggregation, extraArgs may not set " + ", ".join(DISAGGREGATION_FLAGS) + ": Loom sets them",
            field_path=".extraArgs"),
    )

    max_model_len: MaxModelLen | None = Field(
        None, description="vllm --max-model-len: longest prompt + completion in tokens (default: the model's).")
    gpu_memory_utilization: GpuMemoryUtilization | None = Field(
        None, description="vllm --gpu-memory-utilization: GPU memory fraction for weights and KV cache (0.9).")
    kv_cache_memory_bytes: KvCacheMemoryBytes | None = Field(
        None, description="vllm --kv-cache-memory-bytes: the KV cache's size (overrides the GPU memory fraction; "
                          "on CPU, the KV-cache space). Default without GPUs (unless gpuMemoryUtilization is set): a "
                          "quarter of the pod's memory limit, else of its request, at least 256 MiB; 1 GiB when "
                          "neither is set.")
    dtype: Dtype = Field("auto", description="vllm --dtype.")
    # At most the GPUs a pod may ask for (spec.gpus), below the runtime's own bound.
    tensor_parallel_size: Annotated[int, Field(ge=1, le=16)] | None = Field(
        None, description="vllm --tensor-parallel-size (default: spec.gpus when GPUs are asked, else 1).")
    parallelism: Parallelism | None = Field(
        None, description="The engine spread over tensor, pipeline and data parallel ranks, and over several pods "
                          "per replica (a LeaderWorkerSet group; needs LeaderWorkerSet installed in the cluster).")
    disaggregation: Disaggregation | None = Field(
        None, description="Prefill and decode in two pools of their own replicas, the KV cache handed over between "
                          "them (replaces spec.replicas; no autoscaling, canary, adapters or inferencePool with it).")
    enable_prefix_caching: bool | None = Field(None, description="vllm --[no-]enable-prefix-caching (vLLM: on).")
    max_num_seqs: MaxNumSeqs | None = Field(
        None, description="vllm --max-num-seqs: most sequences decoded together.")
    chat_template: str | None = Field(
        None, max_length=65_536, description="A Jinja chat template used instead of the tokenizer's.")
    enforce_eager: bool = Field(False, description="vllm --enforce-eager: no graph compilation (faster start).")
    max_loaded_adapters: MaxLoras | None = Field(
        None, description="vllm --max-loras: LoRA adapters a replica holds in the engine at once (vLLM: 1); beyond "
                          "it the least recently used is unloaded and loaded again from its files when asked for.")
    max_adapter_rank: LoraRank | None = Field(
        None, description="vllm --max-lora-rank: the largest adapter rank served (vLLM: 16).")
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64,
        description="Passthrough: any other vllm flag, '--flag' or '--flag=value' (see vLLM's engine arguments).")
    requests_per_minute: RequestsPerMinute | None = Field(
        None, description="Requests per minute per API key (429 past it).")
    tokens_per_minute: TokensPerMinute | None = Field(
        None, description="Prompt + generated tokens per minute per API key (429 past it).")
    # An hour at most through the API: a longer stream holds a replica's slot past any rollout's drain.
    request_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = Field(
        600.0, description="Longest a request (a whole stream) may take.")
    max_tokens: MaxTokensLimit = Field(
        4096, description="Largest max_tokens a request may ask for.")

    def engine_options(self, gpus: int, lora: bool = False) -> EngineOptions:
        """The runtime's engine options; tensor parallelism defaults to the pod's GPUs; `lora`: the service has
        spec.adapters (the engine starts with LoRA on)."""
        return EngineOptions(
            max_model_len=self.max_model_len, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, dtype=self.dtype,
            tensor_parallel_size=(
                self.parallelism.tensor if self.parallelism else self.tensor_parallel_size or max(1, gpus)
            ),
            enable_prefix_caching=self.enable_prefix_caching, max_num_seqs=self.max_num_seqs,
            chat_template=self.chat_template, enforce_eager=self.enforce_eager, extra_args=list(self.extra_args),
            enable_lora=lora or None, max_loras=self.max_loaded_adapters if lora else None,
            max_lora_rank=self.max_adapter_rank if lora else None,
        )


class DisaggregationPoolStatus(ApiModel):
    replicas: int = Field(0, description="Replicas the pool asks for.")
    ready_replicas: int = 0
    updated_replicas: int = Field(0, description="Replicas running the pool's current template (kv-version).")


class DisaggregationStatus(ApiModel):
    """The stable track's two pools; the service is Ready only while both have a ready replica."""

    prefill: DisaggregationPoolStatus = Field(default_factory=DisaggregationPoolStatus)
    decode: DisaggregationPoolStatus = Field(default_factory=DisaggregationPoolStatus)
    kv_version: str | None = Field(None, description="The kv-version (model, engine, image) the pools roll to: "
                                   "only a prefill and a decode replica of the same one are paired.")


class AdapterFromTrainingJob(ApiModel):
    """A TrainingJob's LoRA adapter: its peft export (<checkpoint.uri>/final/adapter) once the job succeeded; a job
    that succeeds again (re-created) loads its new adapter into the running replicas."""

    name: DnsName = Field(description="TrainingJob name (same namespace; spec.finetune trains an adapter).")


class Adapter(ApiModel):
    """A LoRA adapter served beside the base model: requests select it by `model: <name>`. Loaded into and
    unloaded from the running engine when the list changes, without restarting a replica."""

    model_config = validations(
        cel(
            "[has(self.uri), has(self.mlflow), has(self.fromTrainingJob)].filter(x, x).size() == 1",
            "set exactly one of uri, mlflow or fromTrainingJob",
        ),
    )

    name: str = Field(
        description="The adapter's model name in the OpenAI API (unique; not the base model's name).",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", max_length=63,
    )
    uri: str | None = Field(
        None, description="s3://bucket/prefix of a peft adapter folder (adapter_config.json, "
        "adapter_model.safetensors), read with the service's S3 settings (model.endpoint and model.secretRef, "
        "or the operator's defaults).", pattern=r"^s3://.+", max_length=1024,
    )
    mlflow: str | None = Field(
        None, description="MLflow registry URI of a registered adapter: models:/name/version or models:/name@alias "
        "(an alias is resolved when the adapter is loaded).",
        pattern=r"^models:/[^/@]+(/[0-9]+|@[A-Za-z0-9_\-]+)$", max_length=512,
    )
    from_training_job: AdapterFromTrainingJob | None = None
    version: str | None = Field(
        None, description="A version label: changing it loads the adapter again (new files at the same uri).",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", max_length=63,
    )
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URL for an mlflow adapter (default: model.trackingUri, then the "
        "operator's).", max_length=1024,
    )


class AdapterReplicaStatus(ApiModel):
    pod: str
    state: AdapterState
    reason: str | None = Field(None, description="Why it failed (Failed), or what it waits for.")


class AdapterStatus(ApiModel):
    """One adapter of spec.adapters: where it comes from now, and its state on each ready replica."""

    name: str
    state: AdapterState = Field(description="Loaded: on every ready replica; Failed: on one at least (reason); "
                                "Pending: not resolved yet (reason) or no replica reported; else Loading.")
    source: str | None = Field(None, description="The resolved location (s3:// or models:/).")
    version: str | None = None
    reason: str | None = None
    replicas: list[AdapterReplicaStatus] = Field(default_factory=list)
