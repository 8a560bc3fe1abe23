"""The endpoint picker's configuration: the contract between the operator and the picker pod.

The operator renders a ``PickerConfig`` as JSON into the pod's ``LOOM_PICKER_CONFIG`` variable (a change of it is a
new pod template, so the Deployment rolls it out). Pydantic only: the operator imports this module.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loom.workloads.common.config import CamelModel, WorkloadConfig, label_selector

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
Priority = Annotated[int, Field(ge=-1000, le=1000)]
MaxInflightPerReplica = Annotated[int, Field(ge=1, le=100_000)]
MaxQueued = Annotated[int, Field(ge=0, le=1_000_000)]
MaxQueueWaitSeconds = Annotated[float, Field(gt=0, le=3600)]
DEFAULT_PRIORITY_HEADER = "x-loom-priority"
DEFAULT_MAX_QUEUED = 1000
DEFAULT_MAX_QUEUE_WAIT_S = 60.0


class FlowControlConfig(CamelModel):
    """Flow control (flow.py): at most `max_inflight_per_replica` requests in flight per ready replica; beyond, they
    wait in priority order, tenants taking turns; past `max_queued` waiting, the lowest priority is shed (429)."""

    max_inflight_per_replica: MaxInflightPerReplica = Field(
        description="Requests in flight per ready replica before new ones wait (the engine's batch: vllm "
        "--max-num-seqs is a good start).")
    max_queued: MaxQueued = Field(DEFAULT_MAX_QUEUED, description="Requests waiting before the lowest priority's "
                                  "newest is shed with 429 (0: shed everything beyond the in-flight limit).")
    max_queue_wait_seconds: MaxQueueWaitSeconds = Field(
        DEFAULT_MAX_QUEUE_WAIT_S, description="A request that waited this long is answered 429 with Retry-After.")
    priority_header: HeaderName = Field(DEFAULT_PRIORITY_HEADER, description="A request's priority (an integer, "
                                        "higher first), at most its tenant's: a client may only lower its own.")
    default_priority: Priority = Field(0, description="The priority of a tenant not in tenantPriorities.")
    tenant_header: HeaderName | None = Field(None, description="The fairness key's header (e.g. set by a gateway); "
                                             "None: the API key's id (key-<first 12 hex of its sha256>).")
    tenant_priorities: dict[str, Priority] = Field(
        default_factory=dict, max_length=1000, description="Tenant -> its priority (the most a request of it gets).")


class KvEventsConfig(CamelModel):
    """Precise prefix routing (precise.py): the replicas' engines publish their KV-cache events (vLLM
    --kv-events-config, ZMQ) and the picker tokenizes prompts with the model's tokenizer to match them."""

    port: int = Field(5557, ge=1, le=65535, description="Each replica's ZMQ publisher port.")
    topic: str = Field("", max_length=256, description="The events' topic (vLLM's kv-events-config topic).")
    tokenizer_dir: str | None = Field(None, min_length=1, description="The model's folder (tokenizer.json, "
                                      "tokenizer_config.json); None: read once from a replica's front.")
    silence_seconds: float = Field(5.0, gt=0, le=3600, description="No event this long after a request was sent to "
                                   "a replica: its events are not trusted (the estimate is used).")
    relearn_seconds: float = Field(30.0, ge=0, le=3600, description="After a gap in a replica's events, the estimate "
                                   "is used this long while its set is rebuilt.")


LabelName = Annotated[str, Field(pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$", max_length=316)]
PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"


class DisaggregationConfig(CamelModel):
    """Prefill/decode disaggregation (disaggregation.py): each generation request is prefilled on a `prefill` pod
    (its engine stores the prompt's KV through the KV connector), then served by a `decode` pod of the same KV
    version (its engine loads that KV instead of computing it). Pods are told apart by two labels the operator sets."""

    role_label: LabelName = Field("loom.dev/role", description=f"Pod label: {PREFILL_ROLE!r} or {DECODE_ROLE!r}.")
    version_label: LabelName = Field("loom.dev/kv-version", description="Pod label equal on a prefill and a decode "
                                     "pod whose KV caches are interchangeable (same model, same engine config): "
                                     "never paired across values, so a rollout never mixes versions.")
    prefill_timeout_seconds: float = Field(120.0, gt=0, le=3600, description="A prefill hop not answered by then "
                                           "is given up: the decode replica prefills by itself.")


class LeaderElectionConfig(CamelModel):
    """Several picker pods, one serving (election.py): the one holding the Lease `lease_name` is ready (its Service
    endpoint, gRPC health `readiness`); the others stand by and take over when it stops renewing."""

    lease_name: str = Field(min_length=1, max_length=253, description="The Lease (coordination.k8s.io/v1) in the "
                            "picker's namespace; the operator creates it, the pods only read and update it.")
    duration_seconds: float = Field(15.0, gt=0, le=600, description="A standby takes over once the Lease's record "
                                    "has not changed this long.")
    renew_deadline_seconds: float = Field(10.0, gt=0, le=600, description="The leader stops leading when it has "
                                          "not renewed for this long (less than durationSeconds).")
    retry_seconds: float = Field(2.0, gt=0, le=60, description="How often the Lease is read (and renewed).")


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
    ext_proc_port: int | None = Field(None, ge=1, le=65535, description="Where the picker answers a gateway's "
                                      "Envoy over gRPC: ext_proc (GIE's endpoint-picker protocol) and grpc.health.v1 "
                                      "(None: its own HTTP proxy only).")
    ext_proc_fallbacks: int = Field(0, ge=0, le=16, description="Replicas named after the chosen one in "
                                    "x-gateway-destination-endpoint, for a gateway that retries on another; 0: the "
                                    "one chosen, the single ip:port an Envoy ORIGINAL_DST cluster reads.")
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
    flow_control: FlowControlConfig | None = Field(None, description="None: every request is routed at once.")
    kv_events: KvEventsConfig | None = Field(None, description="None: prefixes are estimated from what was sent.")
    leader_election: LeaderElectionConfig | None = Field(None, description="None: this pod is the only picker and "
                                                         "always serves.")
    disaggregation: DisaggregationConfig | None = Field(None, description="None: every replica serves whole "
                                                        "requests.")
    log_level: str = "info"

    def selector_string(self) -> str:
        return label_selector(self.pod_selector)
