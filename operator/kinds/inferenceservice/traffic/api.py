"""InferenceService spec.routing: how a vllm service's requests are spread over its replicas (the API model).

Kept apart from api.py (one field there) so the kind's other fields grow without touching it. The limits and the
policies are the endpoint picker's own (loom.workloads.picker.config): one definition.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loom.workloads.picker.config import (
    DEFAULT_MAX_KV_USAGE,
    DEFAULT_MAX_QUEUE_WAIT_S,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_WAITING,
    DEFAULT_PRIORITY_HEADER,
    HeaderName,
    MaxInflightPerReplica,
    MaxKvUsage,
    MaxQueued,
    MaxQueueWaitSeconds,
    MaxWaiting,
    Policy,
    Priority,
)

from ....core.model import ApiModel, cel, validations


class SessionAffinity(ApiModel):
    header: HeaderName = Field(description="Requests carrying the same value of this header go to the replica "
                                           "the first one went to, while it can take them (e.g. x-session-id).")


class FlowControl(ApiModel):
    """Under saturation the picker holds requests in order of priority, tenants taking turns within a priority,
    and sheds the lowest priority first (429 with Retry-After). A request's tenant is its API key (or the
    tenantHeader's value); its priority is its tenant's, or lower when the request's priority header says so."""

    max_inflight_per_replica: MaxInflightPerReplica = Field(
        description="Requests in flight per ready replica before new ones wait in the picker (the engine's batch, "
        "vllm.engine.maxNumSeqs, is a good start).")
    max_queued: MaxQueued = Field(
        DEFAULT_MAX_QUEUED, description="Requests waiting before the lowest priority's newest is shed with 429 "
        "(0: shed everything beyond the in-flight limit).")
    max_queue_wait_seconds: MaxQueueWaitSeconds = Field(
        DEFAULT_MAX_QUEUE_WAIT_S, description="A request that waited this long is answered 429 with Retry-After.")
    priority_header: HeaderName = Field(
        DEFAULT_PRIORITY_HEADER, description="Header carrying a request's priority (an integer, higher first); "
        "it can lower the request's priority below its tenant's, never raise it.")
    default_priority: Priority = Field(0, description="Priority of a tenant not listed in tenantPriorities.")
    tenant_header: HeaderName | None = Field(
        None, description="Header naming the request's tenant (e.g. set by a gateway in front); unset: the API key "
        "presented, as key-<first 12 hex digits of its SHA-256> (the id the replicas' rate limits use).")
    tenant_priorities: dict[str, Priority] = Field(
        default_factory=dict, max_length=1000,
        description="Tenant -> its priority: the highest a request of that tenant gets.")


class InferencePool(ApiModel):
    """The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1) for this service."""

    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose", description="What a gateway does when the endpoint picker does not answer: FailClose refuses "
        "the request, FailOpen sends it to a replica of its own choosing (the pool's endpointPickerRef.failureMode).")


class Routing(ApiModel):
    """The endpoint picker in front of the replicas (runtime vllm). Without spec.routing, a vllm service that may
    run more than one replica gets prefix-cache; one replica at most gets no picker."""

    model_config = validations(
        cel("!has(self.prefixMatch) || self.prefixMatch != 'events' || !has(self.policy) || "
            "self.policy == 'prefix-cache'", "prefixMatch: events needs policy: prefix-cache",
            field_path=".prefixMatch"),
    )  # fmt: skip

    policy: Policy = Field(
        "prefix-cache",
        description="prefix-cache: to the replica that probably holds most of the prompt in its prefix cache, "
        "weighed against its load; least-loaded: fewest waiting requests and least KV-cache use; round-robin.")
    prefix_match: Literal["estimate", "events"] = Field(
        "estimate", description="How prefix-cache knows what each replica holds. estimate: from the prompts it sent "
        "there; events: from the engines' own KV-cache events (vLLM publishes them over ZMQ on each replica's port "
        "5557, which the picker subscribes to), over the prompts' tokens (the picker reads the model's tokenizer "
        "once from a replica), falling back to the estimate for a replica whose events are missing or lost.")
    picker_replicas: int = Field(
        1, ge=1, le=3, description="Endpoint picker pods. One serves at a time, chosen by a Lease (<name>-picker); "
        "with more, the others stand by (running, not Ready, out of the Service) and one takes over within about "
        "15 s when the serving one stops renewing, without waiting for a new pod to be scheduled and started.")
    session_affinity: SessionAffinity | None = None
    max_waiting_requests: MaxWaiting = Field(
        DEFAULT_MAX_WAITING, description="A replica with this many requests waiting in its engine is overloaded and "
        "gets nothing new (unless every replica is).")
    max_kv_cache_usage: MaxKvUsage = Field(
        DEFAULT_MAX_KV_USAGE, description="A replica whose KV cache is this full (0-1) is overloaded and gets "
        "nothing new (unless every replica is).")
    inference_pool: InferencePool | None = Field(
        None, description="Also route through a Gateway API gateway: an InferencePool named after the service "
        "(its replicas' pods and port, the endpoint picker's gRPC Service <name>-picker as endpointPickerRef) for "
        "an HTTPRoute to point at; the picker answers the gateway over ext_proc, with the same decisions as its "
        "own proxy. The InferencePool CRD must be installed. An InferencePool of that name not made by this "
        "service is left as it is (condition InferencePool).")
    flow_control: FlowControl | None = Field(
        None, description="Queue by priority and share fairly between tenants once the replicas are saturated; "
        "unset: every request is routed at once.")
