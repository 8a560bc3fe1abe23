"""Prefill/decode pairing (disaggregation.py): a client's request only ever goes to a decode replica, its prefill
only to a prefill replica of the decode's kv-version (never across: a rollout runs two versions of both pools at
once), the fallbacks to decode-only, and the one-token prefill body."""

from __future__ import annotations

import json

import pytest

from loom.workloads.picker.__main__ import fixed_pods
from loom.workloads.picker.config import DisaggregationConfig, PickerConfig
from loom.workloads.picker.decide import Decider, PickRequest, Refused, Routed
from loom.workloads.picker.disaggregation import choose_prefill, prefill_body, prefill_partners, serving_endpoints
from loom.workloads.picker.engine_metrics import EngineLoad
from loom.workloads.picker.gate import gate_for
from loom.workloads.picker.kube import ready_replicas
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod

CHAT = "/v1/chat/completions"


def body(prompt: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], **extra}).encode()


def pods(*specs: tuple[str, str | None, str | None]) -> dict[str, Pod]:
    """(endpoint, role, kv-version) -> the picker's pods."""
    return {e: Pod(f"pod-{e}", "stable", role, version) for e, role, version in specs}


def state(replicas: dict[str, Pod], disaggregated: bool = True) -> PickerState:
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"},
                                          "disaggregation": {} if disaggregated else None})
    s = PickerState(config, PickerMetrics("ml/chat"), draw=lambda: 0.5)
    s.set_replicas(replicas)
    return s


# Two versions of both pools live at once: a rollout from v1 to v2 half way.
ROLLOUT = pods(("p1a:8080", "prefill", "v1"), ("p1b:8080", "prefill", "v1"), ("d1:8080", "decode", "v1"),
               ("p2:8080", "prefill", "v2"), ("d2a:8080", "decode", "v2"), ("d2b:8080", "decode", "v2"))


def test_only_decode_replicas_serve_and_prefill_partners_share_the_kv_version() -> None:
    assert serving_endpoints(ROLLOUT) == {"d1:8080", "d2a:8080", "d2b:8080"}
    assert prefill_partners(ROLLOUT, "d1:8080") == {"p1a:8080", "p1b:8080"}
    assert prefill_partners(ROLLOUT, "d2b:8080") == {"p2:8080"}
    assert prefill_partners(ROLLOUT, "gone:8080") == frozenset()  # no longer listed: no pairing on stale data


def test_a_replica_without_a_version_or_role_serves_whole_requests_and_never_pairs() -> None:
    mixed = pods(("p:8080", "prefill", None), ("d:8080", "decode", None), ("plain:8080", None, None))
    assert serving_endpoints(mixed) == {"d:8080", "plain:8080"}
    assert prefill_partners(mixed, "d:8080") == frozenset()  # prefill and decode both unversioned: not paired
    assert prefill_partners(mixed, "plain:8080") == frozenset()


async def test_during_a_rollout_no_request_pairs_across_versions() -> None:
    s = state(ROLLOUT)
    decider = Decider(s)
    seen = set()
    for i in range(60):
        prompt = f"request {i}: " + "a long shared question " * (i % 7 + 1) * 20
        routed = await decider.decide(PickRequest(CHAT, body(prompt), {}))
        assert isinstance(routed, Routed)
        decode = ROLLOUT[routed.endpoint]
        assert decode.role == "decode"
        prefill = choose_prefill(s, CHAT, body(prompt), {}, routed.endpoint)
        assert prefill is not None
        partner = ROLLOUT[prefill.decision.endpoint]
        assert partner.role == "prefill" and partner.kv_version == decode.kv_version
        seen.add((decode.kv_version, prefill.decision.endpoint))
        s.done(prefill.decision.endpoint)
        decider.finished(routed)
    assert {v for v, _ in seen} == {"v1", "v2"}  # both versions took requests: the test covers both
    assert s.inflight == {}  # every hop given back


async def test_no_prefill_replica_of_the_version_leaves_the_decode_alone() -> None:
    # v2's decode is up, its prefill pool not yet (or all gone): v1's prefill replicas must not be used.
    s = state(pods(("p1:8080", "prefill", "v1"), ("d2:8080", "decode", "v2")))
    routed = await Decider(s).decide(PickRequest(CHAT, body("hello " * 300), {}))
    assert isinstance(routed, Routed) and routed.endpoint == "d2:8080"
    assert choose_prefill(s, CHAT, body("hello " * 300), {}, routed.endpoint) is None
    assert s.inflight == {"d2:8080": 1}


def test_overloaded_prefill_replicas_leave_the_decode_alone() -> None:
    s = state(pods(("p:8080", "prefill", "v1"), ("d:8080", "decode", "v1")))
    s.observe("p:8080", EngineLoad(waiting=1000))
    assert choose_prefill(s, CHAT, body("hello"), {}, "d:8080") is None
    s.observe("p:8080", EngineLoad(waiting=0))
    pick = choose_prefill(s, CHAT, body("hello"), {}, "d:8080")
    assert pick is not None and pick.decision.endpoint == "p:8080" and s.inflight["p:8080"] == 1


def test_the_least_loaded_prefill_replica_of_the_version_is_chosen() -> None:
    s = state(pods(("pa:8080", "prefill", "v1"), ("pb:8080", "prefill", "v1"), ("d:8080", "decode", "v1")))
    s.observe("pa:8080", EngineLoad(waiting=3))
    pick = choose_prefill(s, CHAT, body("a fresh prompt " * 50), {}, "d:8080")
    assert pick is not None and pick.decision.endpoint == "pb:8080"


async def test_only_prefill_replicas_ready_is_no_replica() -> None:
    s = state(pods(("p:8080", "prefill", "v1")))
    outcome = await Decider(s, wait_s=0.05).decide(PickRequest(CHAT, body("hi"), {}))
    assert isinstance(outcome, Refused) and outcome.status == 503


async def test_a_gateways_subset_is_narrowed_to_decode_replicas() -> None:
    s = state(ROLLOUT)
    routed = await Decider(s).decide(PickRequest(CHAT, body("hi"), {}, subset=frozenset({"p2:8080", "d2a:8080"})))
    assert isinstance(routed, Routed) and routed.endpoints == ("d2a:8080",)


async def test_without_disaggregation_every_replica_serves() -> None:
    s = state(pods(("p:8080", "prefill", "v1")), disaggregated=False)
    routed = await Decider(s).decide(PickRequest(CHAT, body("hi"), {}))
    assert isinstance(routed, Routed) and routed.endpoint == "p:8080"


def test_the_prefill_body_asks_one_token_without_stream() -> None:
    original = body("hi", max_tokens=64, stream=True, stream_options={"include_usage": True}, min_tokens=8,
                    temperature=0, max_completion_tokens=64, n=2)
    prefill = prefill_body(CHAT, original)
    assert prefill is not None
    assert json.loads(prefill) == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                   "max_completion_tokens": 1, "stream": False, "n": 1, "temperature": 0}
    completion = prefill_body("/v1/completions", json.dumps({"model": "m", "prompt": "x", "best_of": 3}).encode())
    assert completion is not None
    assert json.loads(completion) == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "n": 1}


@pytest.mark.parametrize(("path", "raw"), [("/v1/models", b""), ("/v1/embeddings", b'{"input": "x"}'),
                                           (CHAT, b"not json"), (CHAT, b"[1, 2]")])
def test_no_prefill_for_what_is_no_generation(path: str, raw: bytes) -> None:
    assert prefill_body(path, raw) is None


def test_pods_carry_their_role_and_version_labels() -> None:
    def pod(name: str, ip: str, labels: dict[str, str]) -> dict[str, object]:
        return {"metadata": {"name": name, "labels": labels},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    listed = [pod("a", "10.0.0.1", {"loom.dev/role": "prefill", "loom.dev/kv-version": "abc"}),
              pod("b", "10.0.0.2", {"loom.dev/role": "decode", "loom.dev/kv-version": "abc", "loom.dev/track": "c"})]
    found = ready_replicas(listed, 8080, "loom.dev/track", DisaggregationConfig())
    assert found == {"10.0.0.1:8080": Pod("a", "stable", "prefill", "abc"),
                     "10.0.0.2:8080": Pod("b", "c", "decode", "abc")}
    assert ready_replicas(listed, 8080, "loom.dev/track")["10.0.0.1:8080"] == Pod("a", "stable")


def test_fixed_replicas_take_their_roles_in_order() -> None:
    assert fixed_pods(["a:1", "b:2"], ["prefill:v1", "decode:v1"]) == {
        "a:1": Pod("replica-0", "stable", "prefill", "v1"), "b:2": Pod("replica-1", "stable", "decode", "v1")}
    assert fixed_pods(["a:1"], None) == {"a:1": Pod("replica-0", "stable")}


def test_flow_control_places_are_the_decode_pools() -> None:
    """The in-flight places per replica are the replicas that serve: a prefill replica adds none."""
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"},
                                          "disaggregation": {}, "flow_control": {"max_inflight_per_replica": 4}})
    s = PickerState(config, PickerMetrics("ml/chat"))
    s.set_replicas(pods(("p1:8080", "prefill", "v1"), ("p2:8080", "prefill", "v1"), ("d:8080", "decode", "v1")))
    gate = gate_for(config, s)
    assert gate is not None

    def capacity() -> float | None:
        return s.metrics.registry.get_sample_value("loom_picker_flow_inflight",
                                                   {"service": "ml/chat", "kind": "capacity"})

    assert capacity() == 4
    s.set_replicas(pods(("p1:8080", "prefill", "v1"), ("d:8080", "decode", "v1"), ("d2:8080", "decode", "v1")))
    assert capacity() == 8
