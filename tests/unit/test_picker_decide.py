"""The picker's one decision (decide.py), which its HTTP proxy and its ext_proc service both ask: fallbacks in the
policy's order, the gateway's subset hint, 503 with nothing ready, and the in-flight count a gateway's choice of a
fallback moves."""

from __future__ import annotations

import json

from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.decide import Decider, PickRequest, Refused, Routed
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod

ENDPOINTS = ("10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080")
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a prompt long enough " * 40}]}).encode()


def state(*endpoints: str, policy: str = "prefix-cache") -> PickerState:
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"},
                                          "policy": policy})
    s = PickerState(config, PickerMetrics("ml/chat"), draw=lambda: 0.5)
    s.set_replicas({e: Pod(f"r{i}", "stable") for i, e in enumerate(endpoints)})
    return s


def request(subset: frozenset[str] | None = None) -> PickRequest:
    return PickRequest("/v1/chat/completions", BODY, {}, subset=subset)


async def test_a_decision_names_distinct_fallbacks_after_the_replica_holding_the_prefix() -> None:
    s = state(*ENDPOINTS)
    decider = Decider(s, fallbacks=2)
    first = await decider.decide(request())
    assert isinstance(first, Routed)
    decider.finished(first)
    again = await decider.decide(request())
    assert isinstance(again, Routed) and again.endpoint == first.endpoint  # the prefix's home
    assert again.pick.decision.reason == "prefix"
    assert len(again.endpoints) == 3 and set(again.endpoints) == set(ENDPOINTS)
    assert s.inflight[again.endpoint] == 1


async def test_fallbacks_are_fewer_when_replicas_are_fewer() -> None:
    routed = await Decider(state(ENDPOINTS[0]), fallbacks=2).decide(request())
    assert isinstance(routed, Routed) and routed.endpoints == (ENDPOINTS[0],)


async def test_the_subset_hint_limits_the_choice_and_an_empty_or_foreign_subset_is_a_503() -> None:
    decider = Decider(state(*ENDPOINTS), fallbacks=2)
    only = await decider.decide(request(subset=frozenset({ENDPOINTS[2]})))
    assert isinstance(only, Routed) and only.endpoints == (ENDPOINTS[2],)
    for subset in (frozenset(), frozenset({"10.9.9.9:8080"})):
        refused = await decider.decide(request(subset=subset))
        assert isinstance(refused, Refused) and (refused.status, refused.code) == (503, "picker_no_replica")


async def test_no_replica_is_refused_at_once_without_a_wait() -> None:
    s = state()
    refused = await Decider(s).decide(request())
    assert isinstance(refused, Refused) and refused.status == 503 and refused.retry_after_s == 1
    assert s.metrics.registry.get_sample_value("loom_picker_outcomes_total",
                                               {"service": "ml/chat", "outcome": "no_replica"}) == 1


async def test_a_fallback_that_served_carries_the_request_in_flight_and_its_prefix() -> None:
    s = state(*ENDPOINTS)
    decider = Decider(s, fallbacks=1)
    routed = await decider.decide(request())
    assert isinstance(routed, Routed)
    served = routed.endpoints[1]
    decider.served(routed, served)
    assert dict(s.inflight) == {served: 1}
    decider.finished(routed, served)
    assert not s.inflight
    # The prompt's blocks are now (also) where it was served: a failed-over prefix follows the gateway's choice.
    shares = s.indexes.shares(routed.pick.chains, [served])
    assert shares[served] == 1.0


async def test_round_robin_fallbacks_follow_the_turn() -> None:
    decider = Decider(state(*ENDPOINTS, policy="round-robin"), fallbacks=2)
    firsts = []
    for _ in range(3):
        routed = await decider.decide(request())
        assert isinstance(routed, Routed) and len(set(routed.endpoints)) == 3
        firsts.append(routed.endpoint)
        decider.finished(routed)
    assert sorted(firsts) == sorted(ENDPOINTS)
