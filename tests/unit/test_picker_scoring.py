"""The endpoint picker's pure parts: prompt text, chained block hashes, the per-replica LRU index, the choice."""

from __future__ import annotations

import pytest

from loom.workloads.picker.blocks import Indexes, PrefixIndex, block_hashes, prompt_text
from loom.workloads.picker.engine_metrics import parse
from loom.workloads.picker.scoring import Limits, Replica, choose, load, overloaded, track_of_draw

SYSTEM = "You are a careful assistant for the billing team. " * 20
LIMITS = Limits(max_waiting=8, max_kv_usage=0.9)


def chat(system: str, user: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


# ------------------------------------------------------------------------------------------- prompt and blocks


def test_prompt_text_of_each_api() -> None:
    assert prompt_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert prompt_text("/v1/completions", {"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1"
    chat_text = prompt_text("/v1/chat/completions", chat("sys", "hi"))
    assert chat_text == "<|system|>\nsys\n<|user|>\nhi\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                                       {"type": "text", "text": "b"}]}]}
    assert prompt_text("/v1/chat/completions", parts) == "<|user|>\nab\n"
    assert prompt_text("/v2/models/m/generate", {"text_input": "t"}) == "t"
    assert prompt_text("/v1/chat/completions", {"messages": "nope"}) is None
    assert prompt_text("/v1/models", {}) is None


def test_block_hashes_chain_full_blocks_only() -> None:
    assert block_hashes("abcdefgh", 4) == block_hashes("abcdefghXY", 4)  # the partial block is not counted
    assert len(block_hashes("abcdefgh", 4)) == 2 and block_hashes("abc", 4) == []
    # Same second block after a different first one: a different hash (chained, as the engine's are).
    assert block_hashes("aaaaZZZZ", 4)[1] != block_hashes("bbbbZZZZ", 4)[1]
    # The model starts the chain: another model (or LoRA adapter) shares nothing.
    assert block_hashes("aaaa", 4, seed="m1") != block_hashes("aaaa", 4, seed="m2")
    with pytest.raises(ValueError):
        block_hashes("a", 0)


def test_requests_sharing_a_system_prompt_share_its_blocks() -> None:
    a = block_hashes(prompt_text("/v1/chat/completions", chat(SYSTEM, "first question")) or "", 64)
    b = block_hashes(prompt_text("/v1/chat/completions", chat(SYSTEM, "another, longer question here")) or "", 64)
    other = block_hashes(prompt_text("/v1/chat/completions", chat(SYSTEM.upper(), "first question")) or "", 64)
    index = PrefixIndex(capacity=1000)
    index.add(a)
    shared = len(SYSTEM) // 64
    assert shared - 1 <= index.matched(b) < len(b)
    assert index.matched(other) == 0
    assert index.matched(a) == len(a)


def test_a_block_counts_only_with_every_block_before_it() -> None:
    index = PrefixIndex(capacity=10)
    chain = block_hashes("aaaabbbbcccc", 4)
    index.add(chain[1:])  # the head missing: nothing matches, though later blocks are there
    assert index.matched(chain) == 0


def test_eviction_is_least_recently_used_tail_first() -> None:
    index = PrefixIndex(capacity=4)
    first = block_hashes("aaaabbbbcccc", 4)
    index.add(first)
    second = block_hashes("xxxxyyyy", 4)
    index.add(second)  # 5 blocks for 4 slots: the first request's tail goes, its head stays
    assert index.matched(first) == 2 and first[2] not in index
    assert index.matched(second) == 2
    index.add(first[:1])  # touched again: now the most recent
    index.add(block_hashes("zzzzwwww", 4))  # two more: the oldest tail blocks go (first's second, second's second)
    assert index.matched(first) == 1 and index.matched(second) == 1 and second[1] not in index
    index.resize(1)
    assert len(index) == 1


def test_indexes_shares_and_forgetting_replicas() -> None:
    indexes = Indexes(default_capacity=100)
    chain = block_hashes("aaaabbbbccccdddd", 4)
    indexes.of("10.0.0.1:8080").add(chain[:2])
    indexes.of("10.0.0.2:8080").add(chain)
    assert indexes.shares(chain, ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]) == {
        "10.0.0.1:8080": 0.5, "10.0.0.2:8080": 1.0, "10.0.0.3:8080": 0.0}
    assert indexes.shares([], ["10.0.0.1:8080"]) == {"10.0.0.1:8080": 0.0}
    indexes.keep(["10.0.0.1:8080"])
    assert indexes.shares(chain, ["10.0.0.2:8080"]) == {"10.0.0.2:8080": 0.0}  # a replaced replica starts cold


# ------------------------------------------------------------------------------------------- choice


A, B, C = (Replica("a"), Replica("b"), Replica("c"))


def test_prefix_wins_over_a_somewhat_busier_replica() -> None:
    busy_a = Replica("a", waiting=6, kv_usage=0.8)
    decision = choose("prefix-cache", [busy_a, B, C], {"a": 1.0}, LIMITS)
    assert decision is not None and (decision.endpoint, decision.reason, decision.share) == ("a", "prefix", 1.0)
    # A larger share wins over a smaller one at the same load.
    decision = choose("prefix-cache", [A, B, C], {"a": 0.25, "b": 0.75}, LIMITS)
    assert decision is not None and decision.endpoint == "b"


def test_load_overrides_the_prefix_of_an_overloaded_replica() -> None:
    for loaded in (Replica("a", waiting=8), Replica("a", kv_usage=0.95)):
        assert overloaded(loaded, LIMITS)
        decision = choose("prefix-cache", [loaded, Replica("b", waiting=3), C], {"a": 1.0}, LIMITS)
        assert decision is not None and (decision.endpoint, decision.reason) == ("c", "load_override")
    # Half the prompt on a replica that is nearly full of work loses to an idle one holding nothing? No: the
    # share outweighs the load until overload (0.5 - 0.5*0.95 > 0 - 0).
    near = Replica("a", waiting=7, kv_usage=0.89)
    decision = choose("prefix-cache", [near, B], {"a": 0.5}, LIMITS)
    assert decision is not None and decision.endpoint == "a"
    # A small share on a busy replica loses to an idle one: the load decides (and says so).
    decision = choose("prefix-cache", [Replica("a", waiting=6, kv_usage=0.8), B], {"a": 0.1}, LIMITS)
    assert decision is not None and (decision.endpoint, decision.reason) == ("b", "load_override")


def test_without_any_share_the_least_loaded_wins() -> None:
    decision = choose("prefix-cache", [Replica("a", waiting=2), Replica("b", kv_usage=0.1), Replica("c", waiting=1)],
                      {}, LIMITS)
    assert decision is not None and (decision.endpoint, decision.reason, decision.share) == ("b", "load", 0.0)


def test_ties_go_to_fewest_in_flight_then_in_turn() -> None:
    replicas = [Replica("a", inflight=2), Replica("b", inflight=1), Replica("c", inflight=1)]
    picked = [choose("prefix-cache", replicas, {}, LIMITS, turn=t) for t in range(4)]
    assert [d.endpoint for d in picked if d] == ["b", "c", "b", "c"]
    same = [choose("prefix-cache", [A, B], {"a": 1.0, "b": 1.0}, LIMITS, turn=t) for t in range(2)]
    assert [d.endpoint for d in same if d] == ["a", "b"]
    assert all(d is not None and d.reason == "prefix" for d in same)


def test_all_overloaded_still_routes_to_the_least_loaded() -> None:
    replicas = [Replica("a", waiting=20), Replica("b", waiting=9), Replica("c", waiting=9, kv_usage=0.99)]
    decision = choose("prefix-cache", replicas, {"a": 1.0}, LIMITS)
    assert decision is not None and (decision.endpoint, decision.reason) == ("b", "all_overloaded")
    assert choose("prefix-cache", [], {}, LIMITS) is None


def test_round_robin_and_least_loaded_ignore_prefixes() -> None:
    shares = {"a": 1.0}
    turns = [choose("round-robin", [A, B, Replica("c", waiting=9)], shares, LIMITS, turn=t) for t in range(4)]
    assert [d.endpoint for d in turns if d] == ["a", "b", "a", "b"]  # the overloaded one skipped
    assert all(d is not None and d.reason == "round_robin" for d in turns)
    decision = choose("least-loaded", [Replica("a", waiting=1), B], shares, LIMITS)
    assert decision is not None and (decision.endpoint, decision.reason) == ("b", "least_loaded")


def test_session_affinity_holds_while_the_replica_can_take_it() -> None:
    decision = choose("prefix-cache", [A, B], {"a": 1.0}, LIMITS, session="b")
    assert decision is not None and (decision.endpoint, decision.reason) == ("b", "session")
    decision = choose("prefix-cache", [A, Replica("b", waiting=8)], {"a": 1.0}, LIMITS, session="b")
    assert decision is not None and (decision.endpoint, decision.reason) == ("a", "prefix")
    decision = choose("prefix-cache", [A, B], {}, LIMITS, session="gone")
    assert decision is not None and decision.reason == "load"


def test_the_canary_keeps_its_share_of_replicas() -> None:
    replicas = [Replica("s1"), Replica("s2"), Replica("s3"), Replica("c1", track="canary")]
    assert track_of_draw(replicas, 0.1) == "canary" and track_of_draw(replicas, 0.25) == "stable"
    assert track_of_draw(replicas[:3], 0.1) is None
    # The whole prompt cached on the canary, but the draw says stable: it stays on the stable track.
    decision = choose("prefix-cache", replicas, {"c1": 1.0}, LIMITS, draw=0.9)
    assert decision is not None and decision.endpoint.startswith("s") and decision.reason == "load"
    decision = choose("prefix-cache", replicas, {"s2": 1.0}, LIMITS, draw=0.0)
    assert decision is not None and decision.endpoint == "c1"
    # Over many draws, a quarter of the requests go to the canary.
    chosen = [choose("prefix-cache", replicas, {"s1": 1.0}, LIMITS, draw=i / 100) for i in range(100)]
    assert sum(1 for d in chosen if d and d.endpoint == "c1") == 25


def test_load_is_bounded() -> None:
    assert load(Replica("a", waiting=100, kv_usage=2.0), LIMITS) == 1.0
    assert load(A, LIMITS) == 0.0


# ------------------------------------------------------------------------------------------- engine metrics


ENGINE_TEXT = """\
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="512",enable_prefix_caching="True"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 5000.0
# TYPE loom_llm_requests counter
loom_llm_requests_total{model="m",endpoint="chat",code="200"} 7.0
"""


def test_engine_metrics_are_read_from_the_fronts_exposition() -> None:
    load_ = parse(ENGINE_TEXT)
    assert load_ is not None
    assert (load_.waiting, load_.running, load_.kv_usage) == (3.0, 2.0, 0.25)
    assert (load_.prefix_queries, load_.prefix_hits) == (400.0, 300.0)
    assert (load_.block_size, load_.num_blocks, load_.prompt_tokens) == (128, 512, 5000.0)
    idle = parse(ENGINE_TEXT.replace("3.0", "0.0").replace("2.0", "0.0"))
    assert idle is not None and (idle.waiting, idle.running) == (0.0, 0.0)
    older = parse("\n".join(line for line in ENGINE_TEXT.splitlines() if "prompt_tokens" not in line) + "\n")
    assert older is not None and older.prompt_tokens is None  # an engine without the counter: nothing to learn


def test_a_front_without_its_engines_series_is_no_reading_not_an_idle_engine() -> None:
    # The front's own series only: its engine did not answer in time (busiest then). The last load must stand.
    front_only = "\n".join(line for line in ENGINE_TEXT.splitlines() if "vllm:" not in line) + "\n"
    assert "loom_llm_requests_total" in front_only
    assert parse(front_only) is None
    assert parse("") is None
