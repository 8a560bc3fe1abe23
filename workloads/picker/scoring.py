"""Which replica gets a request (pure: no I/O, no clock, no randomness of its own).

Inputs: the replicas that can take requests now (Ready, not terminating), each with its load as last read from
its engine (waiting requests, KV-cache use) and the picker's own count of requests in flight there; the share
of the request's prompt blocks each one probably holds (blocks.Indexes); the policy; a turn counter and a
draw in [0, 1) from the caller.

1. Canary share: when both tracks have replicas, the draw picks the track in proportion to their replica counts
   (the share the Service gave it), and only that track's replicas compete. Prefix routing never moves traffic
   between a stable and a canary version.
2. Overloaded replicas (waiting >= maxWaitingRequests or KV-cache use >= maxKvCacheUsage) get nothing new. If
   every replica is overloaded, the least loaded one still gets the request (reason all_overloaded): refusing
   is the engine's job, queueing there is no worse than here.
3. A session (the affinity header) stays on the replica it last went to while that one can take it.
4. Policies: round-robin takes turns (it knows no adapters either: the baseline); least-loaded takes the lowest
   load, among the replicas that hold the request's LoRA adapter when one of them can take it; prefix-cache
   takes the highest `share - LOAD_WEIGHT * load + ADAPTER_WEIGHT * holds`, so a replica holding the adapter wins
   until it is overloaded (an adapter load in the engine costs more than any prefix recomputed).
   load is in [0, 1], half waiting/maxWaiting and half KV-cache use, so a replica
   holding the whole prefix keeps its requests until it is overloaded, and a replica holding nothing of it wins
   over a busier one. Ties (equal score) go to the fewest requests in flight from this picker (fresher than
   the polled metrics between two polls), then in turn, so a burst of new prefixes spreads.
Reasons: prefix (the best holds part of the prompt), adapter (it holds the request's adapter, none of the
prompt), load (nobody holds any: the least loaded), load_override
(a replica holding more of the prompt was passed over for its load), session, round_robin, least_loaded,
all_overloaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Reason = Literal["prefix", "adapter", "load", "load_override", "session", "round_robin", "least_loaded",
                 "all_overloaded"]
REASONS: tuple[Reason, ...] = ("prefix", "adapter", "load", "load_override", "session", "round_robin",
                               "least_loaded", "all_overloaded")
LOAD_WEIGHT = 0.5
ADAPTER_WEIGHT = 1.0


@dataclass(frozen=True)
class Replica:
    endpoint: str
    track: str = "stable"
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0


@dataclass(frozen=True)
class Limits:
    max_waiting: int = 8
    max_kv_usage: float = 0.95


@dataclass(frozen=True)
class Decision:
    endpoint: str
    reason: Reason
    share: float  # the share of the prompt's blocks the chosen replica probably holds


def overloaded(replica: Replica, limits: Limits) -> bool:
    return replica.waiting >= limits.max_waiting or replica.kv_usage >= limits.max_kv_usage


def load(replica: Replica, limits: Limits) -> float:
    return 0.5 * min(1.0, replica.waiting / limits.max_waiting) + 0.5 * min(1.0, max(0.0, replica.kv_usage))


def _excess(replica: Replica, limits: Limits) -> float:
    """Load without the cap, to tell overloaded replicas apart."""
    return replica.waiting / limits.max_waiting + replica.kv_usage / limits.max_kv_usage


def track_of_draw(replicas: Sequence[Replica], draw: float) -> str | None:
    """The canary track when the draw falls in its share of the replicas, else the stable one (None: one track)."""
    tracks = {r.track for r in replicas}
    if len(tracks) < 2:
        return None
    canary = sum(1 for r in replicas if r.track == "canary")
    return "canary" if draw < canary / len(replicas) else "stable"


def _in_turn(tied: Sequence[Replica], turn: int) -> Replica:
    return tied[turn % len(tied)]


def choose(
    policy: str,
    replicas: Sequence[Replica],
    shares: Mapping[str, float],
    limits: Limits,
    *,
    turn: int = 0,
    draw: float = 0.0,
    session: str | None = None,
    holders: frozenset[str] = frozenset(),
) -> Decision | None:
    """The replica for one request, and why; None when there is no replica. `holders`: the replicas that hold
    the request's LoRA adapter (empty for the base model, or when nobody holds it yet)."""
    if not replicas:
        return None
    track = track_of_draw(replicas, draw)
    pool = [r for r in replicas if track is None or r.track == track]
    fit = [r for r in pool if not overloaded(r, limits)]

    def share(r: Replica) -> float:
        return shares.get(r.endpoint, 0.0)

    if not fit:
        least = min(_excess(r, limits) for r in pool)
        chosen = _least_inflight([r for r in pool if _excess(r, limits) == least], turn)
        return Decision(chosen.endpoint, "all_overloaded", share(chosen))
    if session is not None:
        for r in fit:
            if r.endpoint == session:
                return Decision(r.endpoint, "session", share(r))
    if policy == "round-robin":
        chosen = _in_turn(fit, turn)
        return Decision(chosen.endpoint, "round_robin", share(chosen))
    if policy == "least-loaded":
        candidates = [r for r in fit if r.endpoint in holders] or fit
        least = min(load(r, limits) for r in candidates)
        chosen = _least_inflight([r for r in candidates if load(r, limits) == least], turn)
        return Decision(chosen.endpoint, "least_loaded", share(chosen))

    def holds(r: Replica) -> float:
        return ADAPTER_WEIGHT if r.endpoint in holders else 0.0

    scores = {r.endpoint: share(r) - LOAD_WEIGHT * load(r, limits) + holds(r) for r in fit}
    best = max(scores.values())
    chosen = _least_inflight([r for r in fit if scores[r.endpoint] == best], turn)
    most = max(share(r) + holds(r) for r in pool)
    if share(chosen) + holds(chosen) < most:
        return Decision(chosen.endpoint, "load_override", share(chosen))
    if share(chosen) > 0:
        return Decision(chosen.endpoint, "prefix", share(chosen))
    return Decision(chosen.endpoint, "adapter" if holds(chosen) else "load", share(chosen))


def _least_inflight(tied: Sequence[Replica], turn: int) -> Replica:
    fewest = min(r.inflight for r in tied)
    return _in_turn([r for r in tied if r.inflight == fewest], turn)
