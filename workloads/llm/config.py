"""The vllm runtime's configuration: the contract between the operator and the LLM server pod.

The operator renders an ``LlmServerConfig`` into the pod's ConfigMap (JSON, camelCase) and the front reads it
back. Engine options are typed with vLLM's own defaults (None = let vLLM decide); ``extraArgs`` is the
documented passthrough for any other ``vllm`` command-line flag. Imports pydantic only, so the operator can
use it without starlette or vLLM installed. Secrets never travel here: API keys are named by a file or an
environment variable, as for the default runtime (loom.workloads.server.config.AuthConfig).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from loom.workloads.common.body_limit import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT_S
from loom.workloads.common.config import CamelModel, WorkloadConfig
from loom.workloads.common.model_name import MODEL_NAME_RULE, ModelName
from loom.workloads.server.config import AuthConfig

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
# The LoRA ranks vLLM accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks).
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
# Flags the front sets itself (where the engine listens, what it serves): a passthrough may not move them.
RESERVED_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--api-key", "--uds")
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*(=.*)?$")
# The limits of each option and budget, declared once: the InferenceService's spec.vllm takes them from here.
MaxModelLen = Annotated[int, Field(ge=16, le=10_000_000)]
GpuMemoryUtilization = Annotated[float, Field(gt=0, le=1)]
KvCacheMemoryBytes = Annotated[int, Field(ge=1)]
MaxNumSeqs = Annotated[int, Field(ge=1, le=65_536)]
MaxLoras = Annotated[int, Field(ge=1, le=256)]
RequestsPerMinute = Annotated[int, Field(ge=1, le=10_000_000)]
TokensPerMinute = Annotated[int, Field(ge=1, le=1_000_000_000)]
MaxTokensLimit = Annotated[int, Field(ge=1, le=1_000_000)]
Port = Annotated[int, Field(ge=1, le=65_535)]
KV_EVENTS_FLAG = "--kv-events-config"


class EngineOptions(CamelModel):
    """vLLM engine options a user sets, each mapped to its ``vllm`` flag (None keeps vLLM's default)."""

    max_model_len: MaxModelLen | None = Field(
        None, description="--max-model-len: longest prompt + completion in tokens (default: the model's).")
    gpu_memory_utilization: GpuMemoryUtilization | None = Field(
        None, description="--gpu-memory-utilization: fraction of GPU memory for weights and KV cache (vLLM: 0.9).")
    kv_cache_memory_bytes: KvCacheMemoryBytes | None = Field(
        None, description="--kv-cache-memory-bytes: KV-cache size; overrides the GPU memory fraction (and is "
                          "the CPU build's KV-cache space).")
    dtype: Dtype = Field("auto", description="--dtype of weights and activations.")
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="--tensor-parallel-size: GPUs of the pod one model is split over.")
    enable_prefix_caching: bool | None = Field(
        None, description="--enable-prefix-caching / --no-enable-prefix-caching (vLLM: on).")
    max_num_seqs: MaxNumSeqs | None = Field(
        None, description="--max-num-seqs: most sequences decoded together (vLLM: 256 on GPU).")
    chat_template: str | None = Field(
        None, description="--chat-template: a Jinja chat template (text) used instead of the tokenizer's.")
    enforce_eager: bool = Field(False, description="--enforce-eager: skip graph compilation (faster start).")
    # None (not False) when off: configs rendered before adapters existed stay byte for byte the same (the pod
    # template's hash covers this file, so a new key would restart every vllm service at an operator upgrade).
    enable_lora: bool | None = Field(None, description="--enable-lora, adapters loaded and unloaded at run time.")
    max_loras: MaxLoras | None = Field(
        None, description="--max-loras: adapters held by the engine at once (vLLM: 1); beyond it the least recently "
                          "used is unloaded and loaded again from its files when asked for.")
    max_lora_rank: LoraRank | None = Field(None, description="--max-lora-rank: the largest adapter rank (vLLM: 16).")
    # None when off, as enable_lora: configs rendered before it existed stay byte for byte the same.
    kv_events_port: Port | None = Field(
        None, description="Publish the engine's KV-cache events (vllm --kv-events-config, ZMQ) on this port of "
                          "every interface, for the endpoint picker's precise prefix routing.")
    extra_args: list[str] = Field(
        default_factory=list, max_length=64,
        description="Passthrough: further vllm flags, each '--flag' or '--flag=value' (the front's own "
                    "flags --model, --served-model-name, --host, --port, --api-key, --uds are refused).")

    @field_validator("extra_args")
    @classmethod
    def _check_extra(cls, value: list[str]) -> list[str]:
        for arg in value:
            if not _FLAG.match(arg):
                raise ValueError(f"extraArgs entry {arg!r} must be '--flag' or '--flag=value'")
            if arg.split("=", 1)[0] in RESERVED_FLAGS:
                raise ValueError(f"extraArgs may not set {arg.split('=', 1)[0]}: the front sets it")
        return value

    @model_validator(mode="after")
    def _one_events_config(self) -> EngineOptions:
        if self.kv_events_port is not None and any(a.split("=", 1)[0] == KV_EVENTS_FLAG for a in self.extra_args):
            raise ValueError(f"extraArgs may not set {KV_EVENTS_FLAG} when kvEventsPort is set: Loom sets it")
        return self


def kv_events_flag(port: int) -> str:
    """vLLM's flag publishing KV-cache events over ZMQ on `port`. The endpoint's host is a wildcard on purpose:
    given a host, vLLM connects its PUB socket to a collector there instead of binding, and the picker, which
    connects to each replica, would hear nothing. The topic is empty (every subscriber's prefix matches)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": ""}
    return f"{KV_EVENTS_FLAG}={json.dumps(config, separators=(',', ':'))}"


def engine_flags(options: EngineOptions, chat_template_file: Path | None = None) -> list[str]:
    """The ``vllm`` flags for ``options`` (pure; the model, name and port are added by the engine adapter)."""
    flags: list[str] = []
    valued = {
        "--max-model-len": options.max_model_len,
        "--gpu-memory-utilization": options.gpu_memory_utilization,
        "--kv-cache-memory-bytes": options.kv_cache_memory_bytes,
        "--max-num-seqs": options.max_num_seqs,
    }
    flags += [f"{flag}={value}" for flag, value in valued.items() if value is not None]
    flags += [f"--dtype={options.dtype}", f"--tensor-parallel-size={options.tensor_parallel_size}"]
    if options.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching")
    if options.enforce_eager:
        flags.append("--enforce-eager")
    if options.enable_lora:
        flags.append("--enable-lora")
        if options.max_loras is not None:
            flags.append(f"--max-loras={options.max_loras}")
        if options.max_lora_rank is not None:
            flags.append(f"--max-lora-rank={options.max_lora_rank}")
    if options.chat_template is not None:
        if chat_template_file is None:
            raise ValueError("a chat template needs a file to be written to")
        flags.append(f"--chat-template={chat_template_file}")
    if options.kv_events_port is not None:
        flags.append(kv_events_flag(options.kv_events_port))
    return flags + list(options.extra_args)


class LlmLimits(CamelModel):
    """Per-key budgets (per minute, moving window) and per-request limits."""

    requests_per_minute: RequestsPerMinute | None = None
    tokens_per_minute: TokensPerMinute | None = Field(
        None, description="Prompt + generated tokens a key may use per minute; past it requests get 429.")
    request_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = Field(
        600.0, description="Longest a request (a whole stream included) may take; then it is cut off.")
    max_tokens_limit: MaxTokensLimit = Field(
        4096, description="Largest max_tokens a request may ask for.")


class LlmServerConfig(WorkloadConfig):
    json_exclude_none: ClassVar[bool] = True

    model_name: ModelName = Field(description=f"The served model name (OpenAI 'model'); {MODEL_NAME_RULE}.")
    model_dir: str = Field(description="The Hugging Face-format model's folder (config.json, weights, tokenizer).")
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=1, le=65_535)] = 8080
    engine_port: Annotated[int, Field(ge=1, le=65_535)] = 8081
    engine_python: str = Field("python3", description="The interpreter that has vLLM installed (its own environment).")
    engine_start_timeout_s: Annotated[float, Field(gt=0, le=7200)] = 900.0
    engine: EngineOptions = Field(default_factory=EngineOptions)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LlmLimits = Field(default_factory=LlmLimits)
    max_request_bytes: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_REQUEST_BYTES
    request_body_timeout_s: Annotated[float, Field(gt=0)] = DEFAULT_REQUEST_BODY_TIMEOUT_S
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    adapters_file: str | None = Field(
        None, description="The adapter list (adapters.AdapterList JSON), read again whenever it changes "
                          "(engine.enableLora).")
    adapters_dir: str | None = Field(None, description="Where adapters are downloaded (default: beside modelDir).")
    adapters_poll_s: Annotated[float, Field(gt=0, le=600)] | None = Field(
        None, description="How often the adapter list's file is looked at for a change (default 1 s).")
