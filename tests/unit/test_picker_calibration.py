"""The picker learns the model's characters per token from the engines' prompt-token counters, and routes a shared
prefix it could not see with the default guess (the local stack's example Llama: about 1.4 characters a token)."""

from __future__ import annotations

import json

from loom.workloads.picker.calibration import MIN_TOKENS, CharsPerToken
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.engine_metrics import EngineLoad
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod
from loom.workloads.picker.testing import route_chat


def test_the_ratio_is_measured_after_enough_tokens_and_moves_only_when_far_off() -> None:
    ratio = CharsPerToken(4.0)
    assert not ratio.observe("a", 1000.0)  # the first reading is where counting starts
    ratio.sent("a", 1400)
    assert not ratio.observe("a", 2000.0) and ratio.measured() is None  # 1,000 tokens: too few to trust
    ratio.sent("a", 1400)
    assert ratio.observe("a", 3000.0)  # 2,800 characters over 2,000 tokens
    assert ratio.value == 1.4
    ratio.sent("a", 1500)
    assert not ratio.observe("a", 4000.0) and ratio.value == 1.4  # 1.43 measured: within 25%, kept


def test_what_went_before_the_first_reading_and_a_restarted_engine_are_not_counted() -> None:
    ratio = CharsPerToken(4.0)
    ratio.sent("a", 10_000)  # before the engine's counter was read: its tokens are in the starting count
    ratio.observe("a", 500.0)
    ratio.sent("a", 3000)
    ratio.observe("a", 0.0)  # the counter went back: the engine restarted, count from here
    ratio.sent("a", 5000)
    assert ratio.observe("a", float(MIN_TOKENS)) and ratio.value == 5000 / MIN_TOKENS


def test_a_fixed_ratio_is_kept_and_engines_that_went_away_leave_the_measure() -> None:
    fixed = CharsPerToken(3.0, fixed=True)
    fixed.observe("a", 0.0)
    fixed.sent("a", 20_000)
    assert not fixed.observe("a", 2000.0) and fixed.value == 3.0 and fixed.measured() == 10.0
    ratio = CharsPerToken(4.0)
    for endpoint in ("a", "b"):
        ratio.observe(endpoint, 0.0)
    ratio.sent("a", 1000)
    ratio.observe("a", 1000.0)
    ratio.keep({"b"})
    ratio.sent("b", 2000)
    assert ratio.observe("b", 1000.0) is False and ratio.measured() is None  # a's tokens left with it


def picker(config: PickerConfig) -> PickerState:
    state = PickerState(config, PickerMetrics("ns/chat"), draw=lambda: 0.0)
    state.set_replicas({e: Pod(f"pod-{e}", "stable") for e in ("a:8080", "b:8080")})
    return state


def chat(state: PickerState, system: str, user: str) -> str:
    return route_chat(state, "llama", ("system", system), ("user", user))


def test_a_prefix_the_default_guess_cannot_see_is_routed_once_the_ratio_is_learned() -> None:
    config = PickerConfig(namespace="ns", service="chat", pod_selector={"app": "chat"})
    state = picker(config)
    tokens = {"a:8080": 0.0, "b:8080": 0.0}
    for endpoint in tokens:
        state.observe(endpoint, EngineLoad(block_size=128, prompt_tokens=0.0))
    # A 300-character system prompt: 2 engine blocks of 128 tokens at 1.4 characters a token, none at 4 (512).
    system = "Tom painted the fence by the river while Ben watched, and the town went by. " * 4

    def serve(rounds: int) -> list[str]:
        chosen = []
        for i in range(rounds):
            endpoint = chat(state, system, f"question {i}")
            chosen.append(endpoint)
            tokens[endpoint] += (len(system) + 40) / 1.4  # what the engine counts for that prompt
            state.observe(endpoint, EngineLoad(block_size=128, prompt_tokens=tokens[endpoint]))
        return chosen

    serve(12)  # by load (no blocks at 4 characters a token) while the ratio is learned
    assert abs(state.chars_per_token.value - 1.4) < 0.2
    assert state.metrics.chars_per_token.labels("ns/chat")._value.get() == state.chars_per_token.value
    before = state.metrics.decisions.labels("ns/chat", "prefix")._value.get()
    chosen = serve(6)
    assert len(set(chosen[1:])) == 1  # the shared system prompt keeps them on one replica now
    assert state.metrics.decisions.labels("ns/chat", "prefix")._value.get() - before >= 5


def test_a_ratio_set_in_the_config_is_used_as_it_is() -> None:
    config = PickerConfig(namespace="ns", service="chat", pod_selector={"app": "chat"}, chars_per_token=2.0)
    state = picker(config)
    state.observe("a:8080", EngineLoad(block_size=16, prompt_tokens=0.0))
    pick = state.pick("/v1/completions", json.dumps({"prompt": "x" * 64_000}).encode(), {})
    assert pick is not None
    state.sent(pick)
    state.observe("a:8080", EngineLoad(block_size=16, prompt_tokens=4000.0))
    assert state.chars_per_token.value == 2.0


def test_prefixes_sent_before_the_ratio_changed_are_still_found_after() -> None:
    state = picker(PickerConfig(namespace="ns", service="chat", pod_selector={"app": "chat"}))
    tokens = {"a:8080": 0.0, "b:8080": 0.0}
    for endpoint in tokens:
        state.observe(endpoint, EngineLoad(block_size=128, prompt_tokens=0.0))
    long_prompts = [f"Manual {i}: " + "every clause of the warranty applies to the fence. " * 40 for i in range(2)]
    homes = []
    for system in long_prompts:  # 2,000+ characters: blocks of 512 characters at the starting guess
        homes.append(chat(state, system, "first"))
        tokens[homes[-1]] += len(system) / 1.4
        state.observe(homes[-1], EngineLoad(block_size=128, prompt_tokens=tokens[homes[-1]]))
    assert state.chars_per_token.value < 2 and state.indexes.block_chars < 256  # learned: the length changed
    before = state.metrics.decisions.labels("ns/chat", "prefix")._value.get()
    assert [chat(state, system, "again") for system in long_prompts] == homes
    assert state.metrics.decisions.labels("ns/chat", "prefix")._value.get() - before == 2


def test_the_index_under_the_old_length_is_dropped_after_a_while() -> None:
    from loom.workloads.picker.blocks import RETIRE_AFTER, BlockIndexes

    indexes = BlockIndexes(default_capacity=100, block_chars=8)
    indexes.add("a", indexes.chains("x" * 64, seed="m"))
    indexes.use(4)
    assert set(indexes.chains("x" * 64, seed="m")) == {4, 8}  # both lengths looked up after the change
    assert indexes.shares(indexes.chains("x" * 64, seed="m"), ["a"]) == {"a": 1.0}  # found under the old one
    for i in range(RETIRE_AFTER):
        indexes.add("a", indexes.chains(f"{i:04d}" * 16, seed="m"))
    assert set(indexes.chains("x" * 64, seed="m")) == {4}  # one hash per prompt again
