"""The `vllm` runtime's pod: the default runtime's Deployment with the server container turned into Loom's
OpenAI-compatible front over the vLLM engine (pure: no I/O).

What stays as it is: the fetch init container (it fetches the Hugging Face-format folder the same way, from S3,
the MLflow registry or a TrainingJob's export, reading the ServerConfig in server.json), the Service, probes
(the front answers /v2/health/*), the preStop sleep and drain, canaries, the activator and autoscaling.
What changes: a second config file, llm.json (loom.workloads.llm.config.LlmServerConfig), the server container's
command, the image (the operator's vllm image, with vLLM), and the pod template's config hash (both files).
"""

from __future__ import annotations

import copy
import hashlib
from decimal import Decimal

from loom.workloads.llm.adapters import ADAPTERS_FILE, AdapterList
from loom.workloads.llm.config import EngineOptions, LlmLimits, LlmServerConfig
from loom.workloads.server.config import AuthConfig, ServerConfig

from ....core.kit import Manifest, memory_bytes
from ..api import InferenceServiceSpec
from .api import VllmSpec
from .multinode import parallel_flags

LLM_CONFIG_FILE = "llm.json"
ENGINE_PORT = 8081
# Where each replica's engine publishes its KV-cache events with spec.routing.prefixMatch events (the picker's
# KvEventsConfig default, as vLLM's examples use it).
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_NAME = "kv-events"
# vLLM loads and (on GPU) compiles before it answers: minutes for a large model. The startup probe allows 20.
STARTUP_FAILURES = 600
OPENAI_PATH = "/v1"
ADAPTERS_DIR = "adapters"
# The KV cache of a replica without GPUs when spec.vllm leaves its size to Loom (issue 52). vLLM's CPU build reads
# --gpu-memory-utilization (0.92 by default) as the share of the *host's* memory to reserve and exits at start when
# less is free, which it never is on a node that runs anything else. So Loom gives it --kv-cache-memory-bytes
# instead: a quarter of the pod's memory limit (else of its request: the rest holds the front, the engine's own
# process and the weights), at least CPU_KV_CACHE_FLOOR, and CPU_KV_CACHE_DEFAULT when the pod names no memory.
CPU_KV_CACHE_SHARE = Decimal(1) / 4
CPU_KV_CACHE_FLOOR = 256 << 20
CPU_KV_CACHE_DEFAULT = 1 << 30
# Flags that size the KV cache: one the user passes through extraArgs is theirs to decide.
_KV_CACHE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def openai_base_url(service_url: str) -> str:
    return service_url + OPENAI_PATH


def cpu_kv_cache_bytes(spec: InferenceServiceSpec) -> int | None:
    """The KV-cache size Loom gives a replica without GPUs whose spec.vllm leaves it open: a quarter of the pod's
    memory limit, else of its memory request, at least CPU_KV_CACHE_FLOOR; CPU_KV_CACHE_DEFAULT when it names
    neither. None (vLLM decides, or the user did) with GPUs, or when kvCacheMemoryBytes, gpuMemoryUtilization or
    either flag in extraArgs is set."""
    vllm = spec.vllm or VllmSpec()
    passed = {arg.split("=", 1)[0] for arg in vllm.extra_args}
    if spec.gpus > 0 or vllm.kv_cache_memory_bytes is not None or vllm.gpu_memory_utilization is not None:
        return None
    if passed.intersection(_KV_CACHE_FLAGS):
        return None
    resources = spec.resources
    for amounts in ((resources.limits if resources else None), (resources.requests if resources else None)):
        memory = memory_bytes((amounts or {}).get("memory", ""))
        if memory is not None:
            return max(CPU_KV_CACHE_FLOOR, int(memory * CPU_KV_CACHE_SHARE))
    return CPU_KV_CACHE_DEFAULT


def kv_events_port(spec: InferenceServiceSpec) -> int | None:
    """The port the engines publish KV-cache events on, when the picker routes by them (spec.routing.prefixMatch
    events with policy prefix-cache); None: no events."""
    routing = spec.routing
    if spec.runtime != "vllm" or routing is None or routing.prefix_match != "events":
        return None
    return KV_EVENTS_PORT if routing.policy == "prefix-cache" else None


def engine_options(spec: InferenceServiceSpec) -> EngineOptions:
    """spec.vllm as the runtime's engine options, with the KV-cache size of a CPU replica (cpu_kv_cache_bytes) and
    the flags of spec.vllm.parallelism."""
    vllm = spec.vllm or VllmSpec()
    options = vllm.engine_options(spec.gpus, lora=spec.adapters is not None)
    if parallel := parallel_flags(spec):  # pipeline/data parallel and several pods per replica (multinode.py)
        options = options.model_copy(update={"extra_args": [*options.extra_args, *parallel]})
    if (events := kv_events_port(spec)) is not None:  # the picker's precise prefix routing follows them
        options = options.model_copy(update={"kv_events_port": events})
    kv_cache = cpu_kv_cache_bytes(spec)
    return options if kv_cache is None else options.model_copy(update={"kv_cache_memory_bytes": kv_cache})


def llm_config(spec: InferenceServiceSpec, server: ServerConfig, config_dir: str = "/etc/loom") -> LlmServerConfig:
    """The front's contract, from the spec and the default runtime's ServerConfig (same name, port, keys)."""
    vllm = spec.vllm or VllmSpec()
    lora = spec.adapters is not None
    return LlmServerConfig(
        model_name=server.model_name,
        # The front follows the fetch step's marker to the model folder; a model image is loaded where it is mounted.
        model_dir=server.storage_uri if server.resolved_storage_kind == "local" and server.storage_uri
        else server.model_dir,
        port=server.port,
        engine_port=ENGINE_PORT,
        engine_python="python",
        engine=engine_options(spec),
        # The adapter list is its own file of the same ConfigMap volume, rewritten in place when it changes; the
        # adapters download into the model cache volume, beside the model.
        adapters_file=f"{config_dir}/{ADAPTERS_FILE}" if lora else None,
        adapters_dir=f"{server.model_dir}/{ADAPTERS_DIR}" if lora else None,
        auth=AuthConfig(api_keys_file=server.auth.api_keys_file, api_keys_env=server.auth.api_keys_env),
        limits=LlmLimits(
            requests_per_minute=vllm.requests_per_minute, tokens_per_minute=vllm.tokens_per_minute,
            request_timeout_s=vllm.request_timeout_seconds, max_tokens_limit=vllm.max_tokens,
        ),
    )


def apply_vllm_runtime(
    spec: InferenceServiceSpec, config_map: Manifest, deployment: Manifest, server: ServerConfig,
    config_dir: str, hash_annotation: str, image: str, adapters: AdapterList | None = None,
) -> tuple[Manifest, Manifest]:
    """The default runtime's (ConfigMap, Deployment) turned into the vllm runtime's; unchanged for other runtimes.
    `image` is the operator's vllm image (settings.vllm_image: vLLM and Loom's workloads, images/vllm.Dockerfile),
    which both containers run unless spec.image names another. `adapters` is spec.adapters resolved (adapters.py):
    written beside llm.json but left out of the template's hash, so a new list changes no pod."""
    if spec.runtime != "vllm":
        return config_map, deployment
    config_map, deployment = copy.deepcopy(config_map), copy.deepcopy(deployment)
    llm_json = llm_config(spec, server, config_dir).to_json()
    config_map["data"][LLM_CONFIG_FILE] = llm_json
    if spec.adapters is not None:
        config_map["data"][ADAPTERS_FILE] = (adapters or AdapterList()).to_json()
    template = deployment["spec"]["template"]
    container = next(c for c in template["spec"]["containers"] if c["name"] == "server")
    drain = container["command"][container["command"].index("--drain-seconds"):]
    container["command"] = ["python", "-m", "loom.workloads.llm", "--config", f"{config_dir}/{LLM_CONFIG_FILE}", *drain]
    if spec.image is None:
        container["image"] = image
        for init in template["spec"].get("initContainers", []):
            init["image"] = image
    container["startupProbe"]["failureThreshold"] = STARTUP_FAILURES
    if (events := kv_events_port(spec)) is not None:  # the picker connects to it (a ZMQ SUB per replica)
        container["ports"].append({"name": KV_EVENTS_PORT_NAME, "containerPort": events, "protocol": "TCP"})
    annotations = template["metadata"]["annotations"]
    both = annotations[hash_annotation] + llm_json
    annotations[hash_annotation] = hashlib.sha256(both.encode()).hexdigest()[:16]
    return config_map, deployment
