"""The blocks each engine really holds, from its KV-cache events (pure): vLLM's `--kv-events-config` publishes,
per engine step, a batch of BlockStored / BlockRemoved / AllBlocksCleared events (msgpack) with a sequence number.

A BlockStored event names the engine's hashes of the blocks it cached, the hash of the block before the first (None
at a prompt's start), their token ids and the block size. The picker keys each block by its own chain over the
token ids (the key of the block before it and this block's tokens, from a root per LoRA adapter), the same chain it
computes for a request's tokens (`chain`): so matching never depends on the engine's hash function or seed
(sha256, xxhash, PYTHONHASHSEED), only on the tokens, as vLLM's own prefix match does. The engine's hash is kept
to map a BlockRemoved back to the key, and as the parent of the next stored blocks.

Sent, not yet stored: a prompt's blocks are stored (and published) only once the engine has computed them, a few
hundred milliseconds to seconds after the request was sent; requests for the same prefix arriving meanwhile would
find it nowhere and be spread over the replicas. So the blocks of the requests sent to an engine count as held for
`pending_s` after sending (what the estimate assumes forever, assumed here only until the events can tell).

Trust: an engine's set is used only while its stream is whole. A gap in the sequence numbers (the subscriber lost
batches: what was stored or removed meanwhile is unknown), or no event for `silence_s` after a request was sent
to it (events are off or the stream is broken), makes it untrusted: the picker then uses its estimate
(blocks.py) for that replica. After a gap the set is rebuilt from the events that follow and trusted again once
`relearn_s` passed without another gap (by then what is asked for often was stored again, and what was not
shows as a miss, never as a false hit for long: removals keep flowing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

EngineHash = int | bytes


def root_key(lora_name: str | None) -> int:
    return hash(("loom-root", lora_name))


def chain(tokens: Sequence[int], block_size: int, lora_name: str | None = None, limit: int = 4096) -> list[int]:
    """The keys of the full blocks of `tokens` (at most `limit`), each chained to the one before it."""
    keys: list[int] = []
    previous = root_key(lora_name)
    for start in range(0, min(len(tokens) // block_size, limit) * block_size, block_size):
        previous = hash((previous, tuple(tokens[start:start + block_size])))
        keys.append(previous)
    return keys


@dataclass(frozen=True)
class Batch:
    seq: int
    events: list[dict[str, Any]]


def decode(seq_bytes: bytes, payload: bytes) -> Batch:
    """One ZMQ message's sequence frame and payload: `[ts, [event, ...], dp_rank?]`, each event a map with `type`."""
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise ValueError("not a KV event batch")
    return Batch(int.from_bytes(seq_bytes, "big", signed=True), [e for e in body[1] if isinstance(e, dict)])


@dataclass
class EngineBlocks:
    """What one engine holds, as the picker's chain keys."""

    silence_s: float = 5.0
    relearn_s: float = 30.0
    pending_s: float = 10.0
    block_size: int | None = None
    keys: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> chain key
    held: dict[int, int] = field(default_factory=dict)  # chain key -> engine hashes holding it (media, groups)
    last_seq: int | None = None
    last_event_at: float | None = None
    gap_at: float | None = None
    waiting_since: float | None = None  # a request was sent and no event came since
    gaps: int = 0
    unanchored: int = 0  # stored blocks whose parent the picker never saw (stored before it subscribed)
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # chain key -> when a request sent it

    # ------------------------------------------------------------------------------------------- stream

    def apply(self, batch: Batch, now: float) -> None:
        if self.last_seq is not None and batch.seq > self.last_seq + 1:
            self.gaps += 1
            self.gap_at = now
            self._clear()
        elif self.last_seq is not None and batch.seq <= self.last_seq:
            self._clear()  # numbering started again: a new engine process, with an empty cache
        self.last_seq = batch.seq
        self.last_event_at = now
        self.waiting_since = None
        for event in batch.events:
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for engine_hash in _hashes(event.get("block_hashes")):
                    self._removed(engine_hash)
            elif kind == "AllBlocksCleared":
                self._clear()

    def sent(self, now: float, keys: Sequence[int] = ()) -> None:
        """A request was sent to this engine: an event should follow (its prompt's new blocks, or at least the
        blocks of its answer) unless the stream is broken; its blocks (`keys`) are pending until `pending_s`."""
        if self.waiting_since is None:
            self.waiting_since = now
        for key in keys:
            self.pending[key] = now
            self.pending.move_to_end(key)
        while self.pending and now - next(iter(self.pending.values())) > self.pending_s:
            self.pending.popitem(last=False)

    def trusted(self, now: float) -> bool:
        if self.last_event_at is None or self.block_size is None:
            return False
        if self.gap_at is not None and now - self.gap_at < self.relearn_s:
            return False
        return self.waiting_since is None or now - self.waiting_since < self.silence_s

    # ------------------------------------------------------------------------------------------- blocks

    def _stored(self, event: dict[str, Any]) -> None:
        size = event.get("block_size")
        tokens = event.get("token_ids")
        hashes = _hashes(event.get("block_hashes"))
        if not isinstance(size, int) or size < 1 or not isinstance(tokens, list):
            return
        if self.block_size != size:
            if self.block_size is not None:
                self._clear()
            self.block_size = size
        parent = event.get("parent_block_hash")
        lora = event.get("lora_name") if isinstance(event.get("lora_name"), str) else None
        previous = root_key(lora) if parent is None else self.keys.get(parent)
        if previous is None:
            self.unanchored += len(hashes)
            return
        for index, engine_hash in enumerate(hashes):
            block = tokens[index * size:(index + 1) * size]
            if len(block) < size:
                break
            previous = hash((previous, tuple(block)))
            if engine_hash not in self.keys:
                self.keys[engine_hash] = previous
                self.held[previous] = self.held.get(previous, 0) + 1

    def _removed(self, engine_hash: EngineHash) -> None:
        key = self.keys.pop(engine_hash, None)
        if key is None:
            return
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)

    def _clear(self) -> None:
        self.keys.clear()
        self.held.clear()

    def matched(self, keys: Sequence[int], now: float | None = None) -> int:
        """Leading blocks held (or, given `now`, pending: sent within `pending_s`)."""
        count = 0
        for key in keys:
            if key not in self.held:
                sent = self.pending.get(key) if now is not None else None
                if sent is None or now is None or now - sent > self.pending_s:
                    break
            count += 1
        return count


def _hashes(value: object) -> list[EngineHash]:
    if not isinstance(value, list):
        return []
    return [h for h in value if isinstance(h, int | bytes)]


class EngineIndexes:
    """One EngineBlocks per replica endpoint; `shares` for the trusted ones only."""

    def __init__(self, silence_s: float = 5.0, relearn_s: float = 30.0, pending_s: float = 10.0) -> None:
        self.silence_s, self.relearn_s, self.pending_s = silence_s, relearn_s, pending_s
        self.by_endpoint: dict[str, EngineBlocks] = {}

    def of(self, endpoint: str) -> EngineBlocks:
        blocks = self.by_endpoint.get(endpoint)
        if blocks is None:
            blocks = self.by_endpoint[endpoint] = EngineBlocks(self.silence_s, self.relearn_s, self.pending_s)
        return blocks

    def sent(self, endpoint: str, tokens: Sequence[int] | None, now: float, lora_name: str | None = None) -> None:
        blocks = self.of(endpoint)
        size = blocks.block_size
        blocks.sent(now, chain(tokens, size, lora_name) if tokens and size else ())

    def keep(self, endpoints: Iterable[str]) -> None:
        for gone in set(self.by_endpoint) - set(endpoints):
            del self.by_endpoint[gone]

    def shares(self, tokens: Sequence[int] | None, endpoints: Sequence[str], now: float,
               lora_name: str | None = None) -> dict[str, float]:
        """The share of the request's full blocks each trusted engine holds; untrusted engines are left out (the
        caller uses its estimate for them)."""
        out: dict[str, float] = {}
        chains: dict[int, list[int]] = {}
        for endpoint in endpoints:
            blocks = self.by_endpoint.get(endpoint)
            if tokens is None or blocks is None or blocks.block_size is None or not blocks.trusted(now):
                continue
            keys = chains.get(blocks.block_size)
            if keys is None:
                keys = chains[blocks.block_size] = chain(tokens, blocks.block_size, lora_name)
            out[endpoint] = blocks.matched(keys, now) / len(keys) if keys else 0.0
        return out
