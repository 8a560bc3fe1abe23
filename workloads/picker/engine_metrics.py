"""What the picker reads from a replica's /metrics (pure parsing of the Prometheus text).

The vllm front passes the engine's `vllm:*` series through on its /metrics (loom.workloads.llm.metrics):
waiting requests and KV-cache use (the load), the prefix-cache query and hit counters (the hit rate the picker
exports per replica), and `vllm:cache_config_info`, whose labels carry the engine's block size and its number of
KV blocks (the index's block size and capacity), and the prompt tokens taken (`vllm:prompt_tokens_total`, from
which the picker learns the model's characters per token: calibration.py). Series of several engines in one pod
are summed.

An exposition without the engine's load gauges is no reading at all (None), never an idle engine: the front
leaves the engine's series out when the engine did not answer in time, which happens when it is busiest.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    prompt_tokens: float | None = None  # None: the engine does not export the counter


def parse(text: str) -> EngineLoad | None:
    values: dict[str, float] = {}
    block_size: int | None = None
    num_blocks: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                block_size = _int(sample.labels.get("block_size")) or block_size
                num_blocks = (_int(sample.labels.get("num_gpu_blocks"))
                              or _int(sample.labels.get("num_cpu_blocks")) or num_blocks)
            elif name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                          "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                          "vllm:prompt_tokens_total"):
                values[name] = values.get(name, 0.0) + sample.value
    if "vllm:num_requests_waiting" not in values and "vllm:num_requests_running" not in values:
        return None
    return EngineLoad(
        waiting=values.get("vllm:num_requests_waiting", 0.0),
        running=values.get("vllm:num_requests_running", 0.0),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        prefix_queries=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits=values.get("vllm:prefix_cache_hits_total", 0.0),
        block_size=block_size,
        num_blocks=num_blocks,
        prompt_tokens=values.get("vllm:prompt_tokens_total"),
    )


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None
