"""Prefill/decode disaggregation, the pairing (pure but for the choice, which reads and moves the picker's state).

A disaggregated service has two pools of replicas, told apart by the pod label `role` (config.DisaggregationConfig):
`prefill` replicas compute a prompt's KV cache and store it through the engines' KV connector; `decode` replicas
load it from there instead of computing it, and generate. The picker chooses the decode replica first (its usual
policy: prefix cache, load; decide.py), then a prefill replica of the SAME `kv-version` (the same policy among
those: a prefill replica keeps its own prefix cache), sends the prefill request (`prefill_body`: one token, no
stream) and then the client's request to the decode replica (prefill_hop.py, the HTTP edge).

Never across kv-versions: the operator gives a prefill and a decode pod equal version labels only when their
engines' KV caches are interchangeable (same model, same engine config), so a rollout running two versions of
both pools never has one version's decode read the other's KV.

Fallbacks, so a request is never lost to the split: no ready prefill replica of the decode's version, or the
prefill hop failing, leaves the decode replica alone; its engine (the connector with kv_role kv_both) finds
nothing stored and prefills the prompt itself. A pod without the role label serves whole requests, never pairs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .config import PREFILL_ROLE

if TYPE_CHECKING:  # state.py asks serving_endpoints (its flow-control capacity counts the replicas that serve)
    from .state import Pick, PickerState, Pod

# The OpenAI generation endpoints (vLLM's disaggregated serving proxies split these two; anything else, e.g.
# /v1/models or /v1/embeddings, goes to a decode replica as it is).
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATION_PATHS = frozenset({COMPLETIONS, CHAT})
# Sampling fields that would contradict a one-token, one-sequence answer (vLLM refuses min_tokens > max_tokens,
# best_of > n), or stream it.
DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "best_of")


def serving_endpoints(pods: Mapping[str, Pod]) -> frozenset[str]:
    """The replicas that may take a client's request: every one but the prefill pool's."""
    return frozenset(e for e, pod in pods.items() if pod.role != PREFILL_ROLE)


def prefill_partners(pods: Mapping[str, Pod], decode_endpoint: str) -> frozenset[str]:
    """The prefill replicas whose stored KV the decode replica at `decode_endpoint` may load: the prefill pool's
    replicas of its kv-version (none for a replica without a version, or one no longer listed)."""
    decode = pods.get(decode_endpoint)
    if decode is None or decode.kv_version is None:
        return frozenset()
    return frozenset(e for e, pod in pods.items() if pod.role == PREFILL_ROLE and pod.kv_version == decode.kv_version)


def prefill_body(path: str, body: bytes) -> bytes | None:
    """The prefill request for a client's request to `path`: the same body with one token to generate, one
    sequence, no stream (vLLM's disaggregated proxies send max_tokens=1). None: not a generation request (another
    path, not a JSON object), which needs no prefill."""
    if path not in GENERATION_PATHS:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    prefill = {k: v for k, v in request.items() if k not in DROPPED_FOR_PREFILL}
    prefill.update(max_tokens=1, stream=False, n=1)
    if path == CHAT and "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1  # the chat API's newer name wins over max_tokens in vLLM
    return json.dumps(prefill).encode()


def choose_prefill(state: PickerState, path: str, body: bytes, headers: Mapping[str, str],
                   decode_endpoint: str) -> Pick | None:
    """The prefill replica for a request going to `decode_endpoint`, counted in flight there (give it back with
    `state.done`); None when no prefill replica of its kv-version can take it (none ready, all overloaded: the
    decode replica prefilling by itself is the overflow, where a whole service would queue on the busiest)."""
    partners = prefill_partners(state.pods, decode_endpoint) - state.overloaded()
    if not partners:
        return None
    pick = state.pick(path, body, headers, only=partners, pool="prefill")
    if pick is not None:
        state.sent(pick)
    return pick
