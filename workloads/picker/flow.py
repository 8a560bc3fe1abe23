"""Flow control's queue (pure): who is sent on now, who waits, in which order, and who is shed.

The picker lets at most `capacity` requests be in flight (the ready replicas times the in-flight limit per replica).
Beyond it, requests wait here, each with a priority (higher is served first) and a fairness key (its tenant). When a
place frees, the next request is taken from the highest priority that has any waiting, and within that priority the
tenants take turns (round-robin over the tenants with requests waiting, each tenant's own requests first come first
served): a tenant that floods the queue makes its own requests wait, not another tenant's. Every request costs one
turn; requests are not weighed by their tokens (the picker does not know a completion's length in advance).

When more than `max_queued` wait, one is shed (answered 429 with Retry-After by the edge): the lowest priority's,
from the tenant with the most requests waiting at that priority, its newest. So an arrival of higher priority
displaces a waiting one of lower priority, and under equal priority the heaviest tenant loses first.

Nothing admitted is lost: every ticket that arrives ends in exactly one of dispatched (its place is held until
`release`), shed, or withdrawn (its client went away, or the edge's wait bound passed); `Outcome` and the
counters say which, and `check` asserts the books balance.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from loom.workloads.server.flow import key_id, presented_key


@dataclass(frozen=True)
class Ticket:
    """One request under flow control; `seq` orders arrivals (and tells two tickets apart)."""

    seq: int
    tenant: str
    priority: int


@dataclass
class Arrival:
    """What an arrival led to: dispatched at once (`dispatched` holds it), queued (neither), or shed tickets
    (the arrival itself, or a waiting one it displaced)."""

    dispatched: list[Ticket] = field(default_factory=list)
    shed: list[Ticket] = field(default_factory=list)


class FlowQueue:
    def __init__(self, max_queued: int, capacity: int = 0) -> None:
        if max_queued < 0:
            raise ValueError("max_queued must be at least 0")
        self.max_queued = max_queued
        self.capacity = max(0, capacity)
        self.inflight = 0
        # priority -> tenant -> its waiting tickets, first come first; the tenants' order is their turn order.
        self._waiting: dict[int, OrderedDict[str, deque[Ticket]]] = {}
        self._queued = 0
        self._seq = itertools.count()
        self.arrived = self.dispatched = self.shed = self.withdrawn = 0

    def __len__(self) -> int:
        return self._queued

    def ticket(self, tenant: str, priority: int) -> Ticket:
        return Ticket(next(self._seq), tenant, priority)

    # ------------------------------------------------------------------------------------------- events

    def arrive(self, ticket: Ticket) -> Arrival:
        self.arrived += 1
        arrival = Arrival()
        if self._queued == 0 and self.inflight < self.capacity:
            self._dispatch(ticket, arrival)
            return arrival
        self._waiting.setdefault(ticket.priority, OrderedDict()).setdefault(ticket.tenant, deque()).append(ticket)
        self._queued += 1
        while self._queued > self.max_queued:
            victim = self._victim()
            self._remove(victim)
            self.shed += 1
            arrival.shed.append(victim)
        self._pump(arrival)
        return arrival

    def release(self) -> list[Ticket]:
        """A dispatched request finished (answered, failed or abandoned): its place goes to the next waiting."""
        if self.inflight <= 0:
            raise ValueError("release without a dispatched request in flight")
        self.inflight -= 1
        return self._pump(Arrival()).dispatched

    def resize(self, capacity: int) -> list[Ticket]:
        """The capacity changed (replicas came or went): waiting requests dispatched into new places. Fewer places
        than in flight take nothing back: the requests in flight finish, and nothing new goes until below."""
        self.capacity = max(0, capacity)
        return self._pump(Arrival()).dispatched

    def withdraw(self, ticket: Ticket) -> bool:
        """A waiting request's client went away or its wait bound passed; False when it is not waiting (already
        dispatched or shed: the caller then holds, or held, its outcome)."""
        tenants = self._waiting.get(ticket.priority)
        queue = tenants.get(ticket.tenant) if tenants else None
        if queue is None or ticket not in queue:
            return False
        self._remove(ticket)
        self.withdrawn += 1
        return True

    # ------------------------------------------------------------------------------------------- order

    def _pump(self, arrival: Arrival) -> Arrival:
        while self._queued and self.inflight < self.capacity:
            self._dispatch(self._next(), arrival)
        return arrival

    def _dispatch(self, ticket: Ticket, arrival: Arrival) -> None:
        self.inflight += 1
        self.dispatched += 1
        arrival.dispatched.append(ticket)

    def _next(self) -> Ticket:
        """The head of the highest priority's tenant whose turn it is; that tenant goes to the back of the turn."""
        priority = max(self._waiting)
        tenants = self._waiting[priority]
        tenant, queue = next(iter(tenants.items()))
        ticket = queue.popleft()
        if queue:
            tenants.move_to_end(tenant)
        else:
            del tenants[tenant]
            if not tenants:
                del self._waiting[priority]
        self._queued -= 1
        return ticket

    def _victim(self) -> Ticket:
        """The lowest priority's heaviest tenant's newest ticket (ties: the tenant whose turn comes last)."""
        tenants = self._waiting[min(self._waiting)]
        heaviest = max(reversed(tenants.items()), key=lambda item: len(item[1]))[1]
        return heaviest[-1]

    def _remove(self, ticket: Ticket) -> None:
        tenants = self._waiting[ticket.priority]
        queue = tenants[ticket.tenant]
        queue.remove(ticket)
        if not queue:
            del tenants[ticket.tenant]
            if not tenants:
                del self._waiting[ticket.priority]
        self._queued -= 1

    # ------------------------------------------------------------------------------------------- books

    def waiting(self) -> dict[tuple[str, int], int]:
        """Waiting requests by (tenant, priority)."""
        return {(tenant, priority): len(queue) for priority, tenants in self._waiting.items()
                for tenant, queue in tenants.items()}

    def check(self) -> None:
        """Every arrival is dispatched, shed, withdrawn or still waiting: none lost, none twice."""
        settled = self.dispatched + self.shed + self.withdrawn + self._queued
        if settled != self.arrived:
            raise AssertionError(f"{self.arrived} arrived but {settled} accounted for")
        if self._queued != sum(self.waiting().values()):
            raise AssertionError("the waiting count disagrees with the queues")


# ----------------------------------------------------------------------------------------------- classification

ANONYMOUS_TENANT = "anonymous"


def tenant_of(headers: Mapping[str, str], tenant_header: str | None) -> str:
    """The fairness key: the named header's value when the service sets one (a gateway's tenant header), else the
    API key's id (the same non-reversible id the replicas' front counts rate limits against; the picker never
    holds the keys, so an unknown key is a tenant here and refused by the front), else anonymous."""
    if tenant_header:
        value = headers.get(tenant_header.lower())
        if value:
            return value[:128]
    key = presented_key(headers.get("authorization"), headers.get("x-api-key"))
    return key_id(key) if key else ANONYMOUS_TENANT


def priority_of(headers: Mapping[str, str], priority_header: str, tenant_default: int) -> int:
    """The request's priority: its header's integer when it is no higher than the tenant's (a client may mark its
    own work less urgent, e.g. batch, never more urgent than its tenant is granted), else the tenant's."""
    raw = headers.get(priority_header.lower())
    if raw is None:
        return tenant_default
    try:
        asked = int(raw.strip())
    except ValueError:
        return tenant_default
    return min(asked, tenant_default)
