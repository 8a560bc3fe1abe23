"""The endpoint picker's configuration: the contract between the operator and the picker pod.

The operator renders a ``PickerConfig`` as JSON into the pod's ``LOOM_PICKER_CONFIG`` variable (a change of it is a
new pod template, so the Deployment rolls it out). Pydantic only: the operator imports this module.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loom.workloads.common.config import WorkloadConfig, label_selector

ENV_VAR = "LOOM_PICKER_CONFIG"
Policy = Literal["prefix-cache", "least-loaded", "round-robin"]
POLICIES: tuple[Policy, ...] = ("prefix-cache", "least-loaded", "round-robin")
DEFAULT_MAX_WAITING = 8
DEFAULT_MAX_KV_USAGE = 0.95
# Until an engine's vllm:cache_config_info is read: vLLM's GPU block size and a small cache.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CAPACITY_BLOCKS = 4096
# English text under a BPE tokenizer: about four characters a token (the picker has no tokenizer; see README).
DEFAULT_CHARS_PER_TOKEN = 4.0

MaxWaiting = Annotated[int, Field(ge=1, le=100_000)]
MaxKvUsage = Annotated[float, Field(gt=0, le=1)]
HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*$", max_length=128)]


class PickerConfig(WorkloadConfig):
    """Everything the picker needs to route one InferenceService's requests over its replicas."""

    namespace: str = Field(min_length=1)
    service: str = Field(min_length=1, description="Name of the InferenceService.")
    pod_selector: dict[str, str] = Field(min_length=1, description="Labels of the model-server pods (both tracks).")
    track_label: str = Field("loom.dev/track", description="Pod label naming the pod's track (stable, canary).")
    target_port: int = Field(8080, ge=1, le=65535, description="The front's port on each replica.")
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=1, le=65535, description="Where the picker takes requests (the Service's).")
    admin_port: int = Field(9090, ge=1, le=65535, description="/healthz and /metrics (never proxied).")
    policy: Policy = "prefix-cache"
    session_header: HeaderName | None = Field(None, description="Requests with the same value go to one replica.")
    base_model: str | None = Field(None, description="The served base model's name: a request for any other "
                                   "`model` asks for a LoRA adapter, routed to a replica holding it (None: no "
                                   "adapters).")
    adapter_slots: int = Field(1, ge=1, le=256, description="Adapters a replica's engine holds at once (vllm "
                               "--max-loras): the picker's memory of where each adapter is, per replica.")
    max_waiting_requests: MaxWaiting = Field(DEFAULT_MAX_WAITING, description="A replica with this many waiting "
                                             "requests (vllm:num_requests_waiting) is overloaded: nothing new.")
    max_kv_cache_usage: MaxKvUsage = Field(DEFAULT_MAX_KV_USAGE, description="A replica whose KV cache is this "
                                           "full (vllm:kv_cache_usage_perc) is overloaded: nothing new.")
    chars_per_token: float | None = Field(None, gt=0, le=64, description="Characters of prompt text per token of "
                                          "the model, fixed; None: learned from the engines' prompt-token counts, "
                                          "starting at 4 (calibration.py).")
    poll_interval_s: float = Field(0.5, gt=0, le=60, description="How often each replica's /metrics is read.")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Larger request bodies get 413.")
    retry_after_seconds: int = Field(1, ge=1, le=3600)
    log_level: str = "info"

    def selector_string(self) -> str:
        return label_selector(self.pod_selector)
