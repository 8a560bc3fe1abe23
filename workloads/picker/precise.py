"""Precise prefix routing: a request's prefix share on each replica from the blocks its engine reports holding
(kv_events.py), over the prompt's real tokens (prompt_tokens.py); the estimate (blocks.py) for every replica whose
event stream is not trusted now (events off, a gap, silence after requests), request by request.

Fed by the subscriber (kv_subscriber.py: `apply`) and by the picker's state (`shares` at each choice, `sent` after).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from .kv_events import EngineIndexes, decode
from .prompt_tokens import PromptTokenizer


class PreciseMetrics:
    def __init__(self, service: str, registry: CollectorRegistry) -> None:
        self.service = service
        self.sources = Counter("loom_picker_prefix_source", "Replicas scored for a request, by where their prefix "
                               "share came from: engine (its KV events) or estimate (what the picker sent there).",
                               ["service", "source"], registry=registry)
        self.batches = Counter("loom_picker_kv_event_batches", "KV-event batches read, by replica.",
                               ["service", "replica"], registry=registry)
        self.gaps = Counter("loom_picker_kv_event_gaps", "Gaps in a replica's KV-event sequence (batches lost): its "
                            "set is rebuilt and the estimate used meanwhile.", ["service", "replica"],
                            registry=registry)


class PrecisePrefix:
    def __init__(self, tokenizer: PromptTokenizer, metrics: PreciseMetrics, silence_s: float = 5.0,
                 relearn_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.engines = EngineIndexes(silence_s, relearn_s)
        self.clock = clock
        # The request last scored, for `sent`: the state sends what it picked right after picking, nothing between.
        self._last: tuple[list[int] | None, str | None] = (None, None)

    def apply(self, endpoint: str, seq_frame: bytes, payload: bytes) -> None:
        blocks = self.engines.of(endpoint)
        gaps = blocks.gaps
        blocks.apply(decode(seq_frame, payload), self.clock())
        self.metrics.batches.labels(self.metrics.service, endpoint).inc()
        if blocks.gaps > gaps:
            self.metrics.gaps.labels(self.metrics.service, endpoint).inc()

    def shares(self, path: str, request: Mapping[str, Any], estimate: Mapping[str, float],
               endpoints: Sequence[str], adapter: str | None = None) -> dict[str, float]:
        tokens = self.tokenizer.tokens(path, request)
        self._last = (tokens, adapter)
        engine = self.engines.shares(tokens, endpoints, self.clock(), adapter)
        self.metrics.sources.labels(self.metrics.service, "engine").inc(len(engine))
        self.metrics.sources.labels(self.metrics.service, "estimate").inc(len(endpoints) - len(engine))
        return {e: engine[e] if e in engine else estimate.get(e, 0.0) for e in endpoints}

    def sent(self, endpoint: str) -> None:
        tokens, adapter = self._last
        self._last = (None, None)
        self.engines.sent(endpoint, tokens, self.clock(), adapter)

    def keep(self, endpoints: Sequence[str]) -> None:
        self.engines.keep(endpoints)
