"""The picker's one decision per request, for both of its front doors: its own HTTP proxy (app.py) and a gateway's
Envoy asking over ext_proc (extproc.py, GIE's endpoint-picker protocol). Either way: `decide(request)` gives where
the request goes (`Routed`: the chosen replica and the fallbacks after it) or why it goes nowhere (`Refused`: the
status the caller answers with), and `finished` tells the picker the request is over.

A routed request is counted in flight on its replica from the decision on (state.sent), until `finished`.
Waiting for a replica (a rollout's gap) is the decider's: the HTTP proxy holds a request up to its bound; the
ext_proc side answers 503 at once, as the protocol asks (the gateway holds no request on the picker's behalf).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .flow import Ticket
from .gate import FlowGate, Shed
from .state import Pick, PickerState


@dataclass(frozen=True)
class PickRequest:
    """What the picker sees of a request: its path, its whole body, its headers (names in lower case, or a
    case-insensitive mapping); `subset`: only these endpoints may take it (GIE's subset hint; None: any ready
    replica); `exclude`: endpoints already tried for it."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    subset: frozenset[str] | None = None
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Routed:
    pick: Pick
    ticket: Ticket | None = None  # its place under flow control (gate.py), given back when it is finished

    @property
    def endpoint(self) -> str:
        return self.pick.decision.endpoint

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The chosen replica first, then its fallbacks."""
        return (self.pick.decision.endpoint, *self.pick.fallbacks)


@dataclass(frozen=True)
class Refused:
    """No replica takes it: `status` 503 (none can) or 429 (shed under load), with the picker's error code and,
    when known, how long to wait before trying again."""

    status: int
    code: str
    message: str
    retry_after_s: int | None = None


Outcome = Routed | Refused

NO_REPLICA = "picker_no_replica"
SHED = "picker_shed"


class Decider:
    """`decide` and `finished` over the picker's state. `wait_s`: how long a request that finds no replica waits
    for one (only on its first try); `fallbacks`: how many replicas after the first a decision names."""

    def __init__(self, state: PickerState, *, wait_s: float = 0.0, fallbacks: int = 0,
                 gate: FlowGate | None = None) -> None:
        self.state = state
        self.wait_s = wait_s
        self.fallbacks = fallbacks
        self.gate = gate
        self._held: set[Ticket] = set()  # places not given back yet: each is given back once, whoever calls twice

    async def decide(self, request: PickRequest) -> Outcome:
        """With flow control, a request first waits for its place (gate.py; 429 when shed); a retry (`exclude`
        set) does not wait again: it had its turn."""
        ticket = None
        if self.gate is not None and not request.exclude:
            try:
                ticket = await self.gate.enter(request.headers)
                self._held.add(ticket)
            except Shed as shed:
                self.state.metrics.outcome("shed")
                return Refused(429, SHED, f"the service is saturated: {shed.reason}", shed.retry_after_s)
        try:
            outcome = await self._decide(request, ticket)
        except BaseException:
            self._leave(ticket)  # cancelled while waiting for a replica: the place goes on
            raise
        if isinstance(outcome, Refused):
            self._leave(ticket)
        return outcome

    def _leave(self, ticket: Ticket | None) -> None:
        if ticket is not None and self.gate is not None and ticket in self._held:
            self._held.discard(ticket)
            self.gate.leave(ticket)

    async def _decide(self, request: PickRequest, ticket: Ticket | None) -> Outcome:
        state = self.state
        waited = False
        while True:
            pick = state.pick(request.path, request.body, request.headers, exclude=request.exclude,
                              only=self._candidates(request.subset), fallbacks=self.fallbacks)
            if pick is not None:
                state.sent(pick)
                return Routed(pick, ticket)
            if self.wait_s > 0 and not request.exclude and not waited:
                waited = True
                if await state.wait(self.wait_s):
                    continue
            state.metrics.outcome("no_replica")
            return Refused(503, NO_REPLICA, "no replica can take the request", state.config.retry_after_seconds)

    def _candidates(self, subset: frozenset[str] | None) -> frozenset[str] | None:
        """With disaggregation, a client's request goes to a decode replica (the prefill hop is the HTTP edge's:
        prefill_hop.py); a prefill replica never takes one whole."""
        if self.state.config.disaggregation is None:
            return subset
        serving = self.state.serving()
        return serving if subset is None else subset & serving

    def served(self, routed: Routed, endpoint: str) -> None:
        """The gateway reports the replica that served the request (one of `routed.endpoints`)."""
        self.state.served_by(routed.pick, endpoint)

    def finished(self, routed: Routed, endpoint: str | None = None) -> None:
        """The request is over (answered, failed or abandoned); `endpoint`: where it was served, if not the first."""
        self.state.done(endpoint or routed.endpoint)
        self._leave(routed.ticket)
