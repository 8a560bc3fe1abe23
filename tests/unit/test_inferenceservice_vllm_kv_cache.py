"""runtime vllm without GPUs: Loom sizes the KV cache from the pod (issue 52).

vLLM's CPU build reads --gpu-memory-utilization (0.92 unless set) as the share of the host's memory to reserve and
exits at start when less is free: a service that leaves the KV cache's size to vLLM crash-loops on any CPU node that
runs anything else. So a replica without GPUs gets --kv-cache-memory-bytes from its pod's memory limit, else its
request (a quarter, at least 256 MiB), else 1 GiB; GPUs, and any size the user gave, are left as they are.
"""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.core.kit import memory_bytes
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.llm.vllm import (
    CPU_KV_CACHE_DEFAULT,
    CPU_KV_CACHE_FLOOR,
    cpu_kv_cache_bytes,
)
from loom.operator.kinds.inferenceservice.render import render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.workloads.llm.config import LlmServerConfig, engine_flags

SMALLEST: dict[str, Any] = {"runtime": "vllm", "model": {"uri": "s3://models/llama/v1"},
                            "auth": {"apiKeysSecretRef": {"name": "keys", "key": "keys"}}}
GiB, MiB = 1 << 30, 1 << 20


def spec(**fields: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({**SMALLEST, **fields})


def kv_flags(**fields: Any) -> list[str]:
    """The engine's KV-cache flags as the front passes them, from the rendered llm.json."""
    wire = {**SMALLEST, **fields}
    parsed = InferenceServiceSpec.model_validate(wire)
    owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "chat", "namespace": "ml", "uid": "u"}, "spec": wire}
    config_map, _ = render_deployment(owner, parsed, "stable", resolve_model(parsed.model, parsed.serving_handler), 1,
                                      "server:test", vllm_image="vllm:test")
    flags = engine_flags(LlmServerConfig.model_validate_json(config_map["data"]["llm.json"]).engine)
    return [f for f in flags if f.startswith(("--kv-cache-memory-bytes", "--gpu-memory-utilization"))]


def test_the_smallest_cpu_service_gets_a_kv_cache_that_fits_no_host_share() -> None:
    """No vllm block, no resources: 1 GiB, never vLLM's 0.92 of the host."""
    assert cpu_kv_cache_bytes(spec()) == CPU_KV_CACHE_DEFAULT == GiB
    assert kv_flags() == [f"--kv-cache-memory-bytes={GiB}"]


def test_from_the_memory_limit_else_the_request_with_a_floor() -> None:
    assert cpu_kv_cache_bytes(spec(resources={"limits": {"memory": "8Gi"}, "requests": {"memory": "2Gi"}})) == 2 * GiB
    assert cpu_kv_cache_bytes(spec(resources={"requests": {"memory": "2Gi", "cpu": "1"}})) == 512 * MiB
    assert cpu_kv_cache_bytes(spec(resources={"limits": {"cpu": "2"}, "requests": {"memory": "4G"}})) == 10**9
    assert cpu_kv_cache_bytes(spec(resources={"limits": {"memory": "512Mi"}})) == CPU_KV_CACHE_FLOOR == 256 * MiB
    assert cpu_kv_cache_bytes(spec(resources={"limits": {"cpu": "2"}})) == GiB  # no memory named: the default
    assert kv_flags(resources={"limits": {"memory": "4Gi"}}) == [f"--kv-cache-memory-bytes={GiB}"]


def test_gpus_and_the_users_own_size_are_left_alone() -> None:
    assert cpu_kv_cache_bytes(spec(gpus=1, resources={"limits": {"memory": "8Gi"}})) is None
    assert kv_flags(gpus=1) == []  # vLLM's GPU default (0.9 of the GPU's memory) is right there
    assert cpu_kv_cache_bytes(spec(vllm={"kvCacheMemoryBytes": 64 * MiB})) is None
    assert kv_flags(vllm={"kvCacheMemoryBytes": 64 * MiB}, resources={"limits": {"memory": "8Gi"}}) == [
        f"--kv-cache-memory-bytes={64 * MiB}"]
    assert kv_flags(vllm={"gpuMemoryUtilization": 0.3}) == ["--gpu-memory-utilization=0.3"]
    assert kv_flags(vllm={"extraArgs": ["--kv-cache-memory-bytes=1000000"]}) == ["--kv-cache-memory-bytes=1000000"]
    assert kv_flags(vllm={"extraArgs": ["--gpu-memory-utilization=0.5"]}) == ["--gpu-memory-utilization=0.5"]


@pytest.mark.parametrize(("quantity", "expected"), [
    ("512Mi", 512 * MiB), ("4Gi", 4 * GiB), ("1G", 10**9), ("1500M", 15 * 10**8), ("1e9", 10**9),
    ("268435456", 256 * MiB), (268435456, 256 * MiB), ("1.5Gi", 3 * GiB // 2), ("", None), ("lots", None),
    ("0", None),
])
def test_memory_quantities(quantity: int | str, expected: int | None) -> None:
    assert memory_bytes(quantity) == expected
