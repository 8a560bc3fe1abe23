"""A request's prompt as a chain of block hashes, and the index of blocks each replica probably holds (pure).

vLLM caches the KV of full blocks of `block_size` tokens, each keyed by a hash of its tokens chained to the hash
of the block before it, so a block is reused only when the whole prefix up to it matches. The picker has no
tokenizer (it would need the model's files and its time): it cuts the prompt's text into blocks of
`block_size * chars_per_token` characters and chains their hashes the same way. A shared prefix of text is a
shared prefix of blocks here as it is in the engine; only full blocks count, as in the engine.

`PrefixIndex` remembers, per replica, the blocks of the requests sent there, as least-recently-used with the
engine's capacity (its number of KV blocks) and the engine's order: when a request's blocks are released, vLLM
puts them on its free list last block first, so a sequence's tail is evicted before its head. Touching a
request's blocks here in that order (last to first, the first ending most recent) evicts the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

MAX_BLOCKS = 4096  # a prompt's blocks beyond this are not indexed (bounds the work per request)


def prompt_text(path: str, body: Mapping[str, Any]) -> str | None:
    """The text the engine will see first, from an OpenAI or OIP-generate body; None when there is none (the
    picker then routes by load). Chat messages are joined role by role: not the model's template, but the same
    messages give the same text, so a shared system prompt is a shared prefix."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for message in messages:
            if not isinstance(message, Mapping):
                return None
            parts.append(f"<|{message.get('role')}|>\n{_content(message.get('content'))}\n")
        return "".join(parts)
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # the first of several prompts (or token ids, hashed as their text)
        return prompt if isinstance(prompt, str) else (str(prompt) if prompt is not None else None)
    text = body.get("text_input")
    return text if isinstance(text, str) else None


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return ""


def block_hashes(text: str, block_chars: int, seed: str = "") -> list[int]:
    """Chained hashes of the text's full blocks of `block_chars` characters; `seed` (the model name) starts the
    chain, as vLLM keys blocks by their LoRA adapter too."""
    if block_chars < 1:
        raise ValueError("block_chars must be at least 1")
    hashes: list[int] = []
    previous = hash(seed)
    for start in range(0, min(len(text) // block_chars, MAX_BLOCKS) * block_chars, block_chars):
        previous = hash((previous, text[start:start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The blocks one replica probably holds: least recently used first, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are held (a block counts only when every block before it does)."""
        count = 0
        for block in hashes:
            if block not in self._blocks:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[int]) -> None:
        """A request's blocks were sent here: touched last to first, then the least recently used evicted."""
        for block in reversed(hashes):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        self.resize(self.capacity)

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Indexes:
    """One PrefixIndex per replica endpoint; a replica that went away takes its index with it."""

    def __init__(self, default_capacity: int) -> None:
        self.default_capacity = default_capacity
        self._by_endpoint: dict[str, PrefixIndex] = {}

    def of(self, endpoint: str) -> PrefixIndex:
        index = self._by_endpoint.get(endpoint)
        if index is None:
            index = self._by_endpoint[endpoint] = PrefixIndex(self.default_capacity)
        return index

    def shares(self, hashes: Sequence[int], endpoints: Sequence[str]) -> dict[str, float]:
        """The share of the request's blocks each endpoint probably holds (0 without blocks)."""
        if not hashes:
            return {e: 0.0 for e in endpoints}
        return {e: (self._by_endpoint[e].matched(hashes) / len(hashes) if e in self._by_endpoint else 0.0)
                for e in endpoints}

    def keep(self, endpoints: Sequence[str]) -> None:
        for gone in set(self._by_endpoint) - set(endpoints):
            del self._by_endpoint[gone]

    def capacities(self) -> dict[str, int]:
        return {endpoint: index.capacity for endpoint, index in self._by_endpoint.items()}


# Requests routed after a change of block length before the index under the old length is dropped.
RETIRE_AFTER = 1000
Chains = dict[int, list[int]]  # a prompt's block hashes under each block length (characters) still indexed


class BlockIndexes:
    """The indexes under the block length in use and under the one before it.

    The length (the engine's block size times the model's characters per token) changes when the picker first reads
    an engine's block size and when it learns the model's characters per token (calibration.py). Every hash changes
    with it, so the blocks indexed under the old length are still looked up under it: no replica's prefixes are
    forgotten at a change. Requests are indexed under the new length only, and the old index is dropped after
    RETIRE_AFTER of them (by then what it knew that is still asked for is known again under the new length), so a
    prompt is hashed twice only for a while after a change.
    """

    def __init__(self, default_capacity: int, block_chars: int) -> None:
        self.default_capacity = default_capacity
        self._generations: list[tuple[int, Indexes]] = [(block_chars, Indexes(default_capacity))]
        self._added_since_change = 0

    @property
    def block_chars(self) -> int:
        return self._generations[0][0]

    def use(self, block_chars: int) -> None:
        if block_chars == self.block_chars:
            return
        current = self._generations[0][1]
        fresh = Indexes(self.default_capacity)
        for endpoint, capacity in current.capacities().items():
            fresh.of(endpoint).resize(capacity)
        self._generations = [(block_chars, fresh), self._generations[0]]
        self._added_since_change = 0

    def chains(self, text: str, seed: str) -> Chains:
        return {chars: block_hashes(text, chars, seed) for chars, _ in self._generations}

    def shares(self, chains: Chains, endpoints: Sequence[str]) -> dict[str, float]:
        best = {e: 0.0 for e in endpoints}
        for chars, indexes in self._generations:
            for endpoint, share in indexes.shares(chains.get(chars, []), endpoints).items():
                best[endpoint] = max(best[endpoint], share)
        return best

    def add(self, endpoint: str, chains: Chains) -> None:
        chars, indexes = self._generations[0]
        if chains.get(chars):
            indexes.of(endpoint).add(chains[chars])
        if len(self._generations) > 1:
            self._added_since_change += 1
            if self._added_since_change >= RETIRE_AFTER:
                del self._generations[1:]

    def resize(self, endpoint: str, capacity: int) -> None:
        for _, indexes in self._generations:
            indexes.of(endpoint).resize(capacity)

    def keep(self, endpoints: Sequence[str]) -> None:
        for _, indexes in self._generations:
            indexes.keep(endpoints)
