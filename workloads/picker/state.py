"""The picker's state: the replicas, their polled load, the prefix indexes, where each LoRA adapter was sent,
sessions and requests in flight.

Fed by the pod watch (`set_replicas`), the metrics poll (`observe`) and the HTTP side (`pick`, `sent`,
`done`). Lost on restart by design: with empty indexes every share is 0 and the choice is by load until the
indexes fill again from the requests routed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .adapters import AdapterPlacement
from .blocks import BlockIndexes, Chains, prompt_text
from .calibration import CharsPerToken
from .config import DEFAULT_BLOCK_SIZE, DEFAULT_CAPACITY_BLOCKS, DEFAULT_CHARS_PER_TOKEN, PickerConfig
from .disaggregation import serving_endpoints
from .engine_metrics import EngineLoad
from .metrics import PickerMetrics
from .scoring import Decision, Limits, Replica, choose, overloaded

if TYPE_CHECKING:  # precise.py needs msgpack and tokenizers, imported only when the picker follows KV events
    from .precise import PrecisePrefix

MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class Pod:
    name: str
    track: str
    role: str | None = None  # prefill or decode, with disaggregation (disaggregation.py); None: whole requests
    kv_version: str | None = None  # a prefill and a decode pod pair only on equal values


@dataclass(frozen=True)
class Pick:
    decision: Decision
    chains: Chains  # the prompt's block hashes under each block length indexed (blocks.BlockIndexes)
    session: str | None
    adapter: str | None = None
    prompt_chars: int = 0  # the length of the prompt text the hashes were cut from
    # The next replicas in the picker's order, for a gateway that tries them when the first fails (GIE's fallbacks).
    fallbacks: tuple[str, ...] = ()


class PickerState:
    def __init__(self, config: PickerConfig, metrics: PickerMetrics,
                 draw: Callable[[], float] = random.random) -> None:
        self.config = config
        self.metrics = metrics
        self.limits = Limits(config.max_waiting_requests, config.max_kv_cache_usage)
        self.pods: dict[str, Pod] = {}
        self.loads: dict[str, EngineLoad] = {}
        self.inflight: Counter[str] = Counter()
        self.adapters = AdapterPlacement(config.adapter_slots)
        self.block_size = DEFAULT_BLOCK_SIZE
        self.chars_per_token = CharsPerToken(config.chars_per_token or DEFAULT_CHARS_PER_TOKEN,
                                             fixed=config.chars_per_token is not None)
        metrics.chars_per_token.labels(metrics.service).set(self.chars_per_token.value)
        self.indexes = BlockIndexes(DEFAULT_CAPACITY_BLOCKS, self._block_chars())
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self._turns: dict[str, itertools.count[int]] = {}  # per pool: prefill picks do not skew decode turns
        self._draw = draw
        self._available = asyncio.Event()
        self.on_replicas: list[Callable[[int], None]] = []
        self.precise: PrecisePrefix | None = None  # the engines' own KV events (precise.py), when followed

    # ------------------------------------------------------------------------------------------- inputs

    def set_replicas(self, pods: Mapping[str, Pod]) -> None:
        """The replicas that can take requests now (Ready, not terminating), by endpoint."""
        self.pods = dict(pods)
        self.indexes.keep(list(self.pods))
        self.chars_per_token.keep(set(self.pods))
        self.adapters.keep(self.pods)
        for gone in set(self.loads) - set(self.pods):
            del self.loads[gone]
        if self.pods:
            self._available.set()
        else:
            self._available.clear()
        for listener in self.on_replicas:  # flow control's places (gate.FlowGate.resize)
            listener(len(self.serving()))
        self._export_replicas()

    def serving(self) -> frozenset[str]:
        """The replicas that take a client's request: all of them, or a disaggregated service's decode pool."""
        return serving_endpoints(self.pods) if self.config.disaggregation is not None else frozenset(self.pods)

    def forget(self, endpoint: str) -> None:
        """A replica that refused a connection (going away): nothing new until the pod watch lists it again."""
        self.set_replicas({e: p for e, p in self.pods.items() if e != endpoint})

    def observe(self, endpoint: str, load: EngineLoad) -> None:
        if endpoint not in self.pods:
            return
        self.loads[endpoint] = load
        if load.block_size:
            self.block_size = load.block_size
        if load.num_blocks:
            self.indexes.resize(endpoint, load.num_blocks)
        if load.prompt_tokens is not None and self.chars_per_token.observe(endpoint, load.prompt_tokens):
            self.metrics.chars_per_token.labels(self.metrics.service).set(self.chars_per_token.value)
        self.indexes.use(self._block_chars())
        if load.prefix_queries > 0:
            self.metrics.hit_ratio.labels(self.metrics.service, self.pods[endpoint].name).set(
                load.prefix_hits / load.prefix_queries)
        self._export_replicas()

    def overloaded(self) -> frozenset[str]:
        """The replicas whose last reading (or the requests in flight) says overloaded."""
        return frozenset(r.endpoint for r in self._replicas() if overloaded(r, self.limits))

    def _export_replicas(self) -> None:
        busy = self.overloaded()
        self.metrics.replicas.labels(self.metrics.service, "ready").set(len(self.pods))
        self.metrics.replicas.labels(self.metrics.service, "overloaded").set(len(busy))
        for endpoint, pod in self.pods.items():
            self.metrics.overloaded.labels(self.metrics.service, pod.name).set(1 if endpoint in busy else 0)

    def _replicas(self, exclude: frozenset[str] = frozenset(), only: frozenset[str] | None = None) -> list[Replica]:
        out = []
        for endpoint in sorted(self.pods):
            if endpoint in exclude or (only is not None and endpoint not in only):
                continue
            load = self.loads.get(endpoint, EngineLoad())
            out.append(Replica(endpoint, self.pods[endpoint].track, load.waiting, load.kv_usage,
                               self.inflight[endpoint]))
        return out

    # ------------------------------------------------------------------------------------------- choice

    def pick(self, path: str, body: bytes, headers: Mapping[str, str],
             exclude: frozenset[str] = frozenset(), only: frozenset[str] | None = None,
             fallbacks: int = 0, pool: str = "serve") -> Pick | None:
        """The replica for a request, among the ready ones not in `exclude` and (unless None) in `only`, and up to
        `fallbacks` more in the order the policy would take them were the first ones gone. `headers`: names in
        lower case (or a case-insensitive mapping). `pool`: whose turns a round robin takes (disaggregation's
        prefill picks have their own)."""
        started = time.perf_counter()
        request = _json_object(body)
        text = self._prompt(path, request) if self.config.policy == "prefix-cache" else None
        chains = self.indexes.chains(text, seed=str((request or {}).get("model", ""))) if text else {}
        adapter = self._adapter(request)
        replicas = self._replicas(exclude, only)
        session = headers.get(self.config.session_header.lower()) if self.config.session_header else None
        shares = self.indexes.shares(chains, [r.endpoint for r in replicas])
        if self.precise is not None and text and request is not None:
            shares = self.precise.shares(path, request, shares, [r.endpoint for r in replicas], adapter)
        turn, draw = next(self._turns.setdefault(pool, itertools.count())), self._draw()
        holders = self.adapters.holders(adapter) if adapter else frozenset()
        decision = choose(self.config.policy, replicas, shares, self.limits, turn=turn, draw=draw,
                          session=self.sessions.get(session) if session else None, holders=holders)
        after: list[str] = []
        while decision is not None and len(after) < fallbacks:
            taken = {decision.endpoint, *after}
            # The same turn and draw: the order the policy gives the rest, not a new request's.
            then = choose(self.config.policy, [r for r in replicas if r.endpoint not in taken], shares, self.limits,
                          turn=turn, draw=draw, holders=holders)
            if then is None:
                break
            after.append(then.endpoint)
        self.metrics.latency.labels(self.metrics.service).observe(time.perf_counter() - started)
        if decision is None:
            return None
        self.metrics.decisions.labels(self.metrics.service, decision.reason).inc()
        if any(chains.values()):
            self.metrics.predicted.labels(self.metrics.service).observe(decision.share)
        return Pick(decision, chains, session, adapter, len(text) if text else 0, tuple(after))

    def _adapter(self, request: dict[str, object] | None) -> str | None:
        """The LoRA adapter a request asks for: a `model` other than the base model's."""
        if request is None or self.config.base_model is None or self.config.policy == "round-robin":
            return None
        model = request.get("model")
        return model if isinstance(model, str) and model and model != self.config.base_model else None

    @staticmethod
    def _prompt(path: str, parsed: dict[str, object] | None) -> str | None:
        # Not a JSON object: the front answers it; routed by load.
        return prompt_text(path, parsed) if parsed is not None else None

    def _block_chars(self) -> int:
        return max(1, round(self.block_size * self.chars_per_token.value))

    def sent(self, pick: Pick) -> None:
        endpoint = pick.decision.endpoint
        if self.precise is not None:
            self.precise.sent(endpoint)
        self.inflight[endpoint] += 1
        self.chars_per_token.sent(endpoint, pick.prompt_chars)
        self.indexes.add(endpoint, pick.chains)
        if pick.adapter:
            self.adapters.sent(endpoint, pick.adapter)
        if pick.session:
            self.sessions[pick.session] = endpoint
            self.sessions.move_to_end(pick.session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        if endpoint in self.pods:
            self.metrics.routed.labels(self.metrics.service, self.pods[endpoint].name).inc()

    def served_by(self, pick: Pick, endpoint: str) -> None:
        """A gateway sent the request to `endpoint`, one of the pick's fallbacks, not the first choice: count it in
        flight there (and the prompt's blocks there) instead."""
        if endpoint == pick.decision.endpoint or endpoint not in self.pods:
            return
        self.done(pick.decision.endpoint)
        self.inflight[endpoint] += 1
        self.indexes.add(endpoint, pick.chains)

    def done(self, endpoint: str) -> None:
        self.inflight[endpoint] -= 1
        if self.inflight[endpoint] <= 0:
            del self.inflight[endpoint]

    async def wait(self, timeout: float) -> bool:
        if self.pods:
            return True
        try:
            await asyncio.wait_for(self._available.wait(), timeout=max(0.0, timeout))
        except TimeoutError:
            return bool(self.pods)
        return True


def _json_object(body: bytes) -> dict[str, object] | None:
    if not body:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
