"""PromQL for the vllm runtime's autoscaling metrics (pure), per pod like the model server's own series.

- llm-waiting-requests: requests the engine queues (vLLM's `vllm:num_requests_waiting`, which the front passes
  through on its /metrics), summed per pod;
- llm-kv-cache-usage: percent of the engine's KV cache in use (`vllm:kv_cache_usage_perc` is a 0..1 ratio);
- llm-ttft-p95: the 95th percentile of the time to first token the front measured
  (`loom_llm_time_to_first_token_seconds`) over the rate window, in seconds. A pod that streamed nothing in the
  window has no quantile (NaN, dropped here) and falls back to 0 like an idle pod, so idleness never holds replicas.
"""

from __future__ import annotations

from collections.abc import Callable

WAITING = "vllm:num_requests_waiting"
KV_CACHE = "vllm:kv_cache_usage_perc"
TTFT = "loom_llm_time_to_first_token_seconds"
LLM_KINDS = ("llm-waiting-requests", "llm-kv-cache-usage", "llm-ttft-p95")


def llm_load(kind: str, select: Callable[[str], str], rate_window_seconds: int) -> str:
    """Per-pod PromQL for an LLM metric; ``select(metric)`` is the metric's selector for the workload's pods."""
    if kind == "llm-waiting-requests":
        return f"sum by (pod) ({select(WAITING)})"
    if kind == "llm-kv-cache-usage":
        return f"100 * max by (pod) ({select(KV_CACHE)})"
    if kind == "llm-ttft-p95":
        buckets = f"sum by (pod, le) (rate({select(TTFT + '_bucket')}[{rate_window_seconds}s]))"
        # NaN >= 0 is false: a pod without streams in the window drops out here.
        return f"(histogram_quantile(0.95, {buckets}) >= 0)"
    raise ValueError(f"not an LLM metric: {kind!r}")
