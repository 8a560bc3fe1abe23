"""Adapter-aware routing: a request for a LoRA adapter goes to a replica that holds it, unless that one is
overloaded; a replica holds at most the engine's slots of adapters, least recently used out first."""

from __future__ import annotations

import pytest

from loom.workloads.picker.adapters import AdapterPlacement
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.engine_metrics import EngineLoad
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.scoring import Limits, Replica, choose
from loom.workloads.picker.state import PickerState, Pod
from loom.workloads.picker.testing import route_chat

LIMITS = Limits(max_waiting=8, max_kv_usage=0.95)
A, B, C = Replica("a"), Replica("b"), Replica("c")


def test_placement_keeps_the_engines_slots_least_recently_used_out_first() -> None:
    placement = AdapterPlacement(slots=2)
    placement.sent("a", "pirate")
    placement.sent("a", "poet")
    placement.sent("a", "pirate")  # used again: now the most recent
    placement.sent("a", "chef")  # a third: poet, least recently used, is evicted
    assert placement.held("a") == ["pirate", "chef"]
    assert placement.holders("poet") == frozenset()
    placement.sent("b", "pirate")
    assert placement.holders("pirate") == frozenset({"a", "b"})
    placement.keep(["b"])  # replica a went away
    assert placement.holders("pirate") == frozenset({"b"}) and placement.held("a") == []
    with pytest.raises(ValueError):
        AdapterPlacement(slots=0)


def test_a_holder_wins_over_an_idler_replica_until_it_is_overloaded() -> None:
    busy_b = Replica("b", waiting=6, kv_usage=0.8)
    decision = choose("prefix-cache", [A, busy_b, C], {}, LIMITS, holders=frozenset({"b"}))
    assert decision is not None and (decision.endpoint, decision.reason) == ("b", "adapter")
    overloaded_b = Replica("b", waiting=8)
    decision = choose("prefix-cache", [A, overloaded_b, C], {}, LIMITS, holders=frozenset({"b"}))
    assert decision is not None and decision.endpoint in ("a", "c") and decision.reason == "load_override"
    # Holding the adapter counts more than the prompt's blocks elsewhere; its own blocks go with it ("prefix").
    decision = choose("prefix-cache", [A, B], {"a": 0.9}, LIMITS, holders=frozenset({"b"}))
    assert decision is not None and decision.endpoint == "b"
    decision = choose("prefix-cache", [A, B], {"b": 0.5}, LIMITS, holders=frozenset({"b"}))
    assert decision is not None and (decision.endpoint, decision.reason, decision.share) == ("b", "prefix", 0.5)


def test_least_loaded_stays_among_holders_and_round_robin_ignores_them() -> None:
    decision = choose("least-loaded", [A, Replica("b", waiting=3)], {}, LIMITS, holders=frozenset({"b"}))
    assert decision is not None and decision.endpoint == "b"
    decision = choose("least-loaded", [A, Replica("b", waiting=8)], {}, LIMITS, holders=frozenset({"b"}))
    assert decision is not None and decision.endpoint == "a"
    turns = {
        choose("round-robin", [A, B], {}, LIMITS, turn=t, holders=frozenset({"b"})).endpoint  # type: ignore[union-attr]
        for t in range(2)
    }
    assert turns == {"a", "b"}


def state(policy: str = "prefix-cache", slots: int = 2) -> PickerState:
    config = PickerConfig(
        namespace="ns",
        service="chat",
        pod_selector={"app": "chat"},
        policy=policy,
        base_model="llama",
        adapter_slots=slots,
    )
    picker = PickerState(config, PickerMetrics("ns/chat"), draw=lambda: 0.0)
    picker.set_replicas({e: Pod(f"pod-{e}", "stable") for e in ("a:8080", "b:8080", "c:8080")})
    for endpoint in ("a:8080", "b:8080", "c:8080"):
        picker.observe(endpoint, EngineLoad())
    return picker


def route(picker: PickerState, model: str, user: str) -> str:
    return route_chat(picker, model, ("user", user))


def test_each_adapters_requests_stay_on_the_replica_that_loaded_it() -> None:
    picker = state()
    first = {adapter: route(picker, adapter, "hi") for adapter in ("pirate", "poet", "chef")}
    assert len(set(first.values())) == 3  # three new adapters, three idle replicas: spread, one each
    for i in range(10):  # different prompts (no shared blocks): the adapter alone keeps them where it is
        for adapter, home in first.items():
            assert route(picker, adapter, f"question {i} for {adapter}") == home
    # The base model's requests are not bound to any replica.
    assert {route(picker, "llama", f"base {i}") for i in range(6)} == {"a:8080", "b:8080", "c:8080"}
    decisions = picker.metrics.decisions.labels("ns/chat", "adapter")._value.get()
    assert decisions == 30


def test_an_overloaded_holder_sends_its_adapter_to_another_replica_which_then_holds_it_too() -> None:
    picker = state()
    home = route(picker, "pirate", "hi")
    picker.observe(home, EngineLoad(waiting=8))
    elsewhere = route(picker, "pirate", "again")
    assert elsewhere != home
    assert picker.adapters.holders("pirate") == frozenset({home, elsewhere})


def test_without_adapters_or_with_round_robin_nothing_is_remembered() -> None:
    picker = state(policy="round-robin")
    route(picker, "pirate", "hi")
    assert picker.adapters.holders("pirate") == frozenset()
    config = PickerConfig(namespace="ns", service="chat", pod_selector={"app": "chat"})
    plain = PickerState(config, PickerMetrics("ns/chat2"), draw=lambda: 0.0)
    plain.set_replicas({"a:8080": Pod("pod-a", "stable")})
    route(plain, "pirate", "hi")
    assert plain.adapters.holders("pirate") == frozenset()
