"""InferenceService spec.routing: how a vllm service's requests are spread over its replicas (the API model).

Kept apart from api.py (one field there) so the kind's other fields grow without touching it. The limits and the
policies are the endpoint picker's own (loom.workloads.picker.config): one definition.
"""

from __future__ import annotations

from pydantic import Field

from loom.workloads.picker.config import (
    DEFAULT_MAX_KV_USAGE,
    DEFAULT_MAX_WAITING,
    HeaderName,
    MaxKvUsage,
    MaxWaiting,
    Policy,
)

from ....core.model import ApiModel


class SessionAffinity(ApiModel):
    header: HeaderName = Field(description="Requests carrying the same value of this header go to the replica "
                                           "the first one went to, while it can take them (e.g. x-session-id).")


class Routing(ApiModel):
    """The endpoint picker in front of the replicas (runtime vllm). Without spec.routing, a vllm service that may
    run more than one replica gets prefix-cache; one replica at most gets no picker."""

    policy: Policy = Field(
        "prefix-cache",
        description="prefix-cache: to the replica that probably holds most of the prompt in its prefix cache, "
        "weighed against its load; least-loaded: fewest waiting requests and least KV-cache use; round-robin.")
    session_affinity: SessionAffinity | None = None
    max_waiting_requests: MaxWaiting = Field(
        DEFAULT_MAX_WAITING, description="A replica with this many requests waiting in its engine is overloaded and "
        "gets nothing new (unless every replica is).")
    max_kv_cache_usage: MaxKvUsage = Field(
        DEFAULT_MAX_KV_USAGE, description="A replica whose KV cache is this full (0-1) is overloaded and gets "
        "nothing new (unless every replica is).")
