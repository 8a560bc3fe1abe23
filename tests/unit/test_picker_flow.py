"""Flow control's queue (workloads/picker/flow.py): order by priority, tenants taking turns, shedding the lowest
priority's heaviest tenant first, and books that balance (nothing admitted lost, nothing dispatched twice)."""

from __future__ import annotations

import random

import pytest

from loom.workloads.picker.flow import ANONYMOUS_TENANT, FlowQueue, Ticket, priority_of, tenant_of
from loom.workloads.server.flow import key_id


def drain(queue: FlowQueue) -> list[Ticket]:
    """Release one place at a time until nothing waits: the order waiting requests are dispatched in."""
    order = []
    while len(queue):
        order += queue.release()
    return order


def full_queue(capacity: int = 1, max_queued: int = 100) -> FlowQueue:
    queue = FlowQueue(max_queued, capacity)
    for _ in range(capacity):
        assert queue.arrive(queue.ticket("warm", 0)).dispatched
    return queue


def test_below_capacity_requests_go_at_once() -> None:
    queue = FlowQueue(max_queued=10, capacity=2)
    first, second, third = (queue.ticket("a", 0) for _ in range(3))
    assert queue.arrive(first).dispatched == [first]
    assert queue.arrive(second).dispatched == [second]
    arrival = queue.arrive(third)
    assert arrival.dispatched == [] and arrival.shed == []
    assert len(queue) == 1
    assert queue.release() == [third]
    queue.check()


def test_higher_priority_goes_first_then_arrival_order() -> None:
    queue = full_queue()
    low1, high1, low2, high2 = (queue.ticket("a", p) for p in (0, 5, 0, 5))
    for ticket in (low1, high1, low2, high2):
        queue.arrive(ticket)
    assert drain(queue) == [high1, high2, low1, low2]


def test_tenants_take_turns_within_a_priority() -> None:
    queue = full_queue()
    flood = [queue.ticket("flood", 0) for _ in range(6)]
    for ticket in flood:
        queue.arrive(ticket)
    quiet = [queue.ticket("quiet", 0) for _ in range(2)]
    for ticket in quiet:
        queue.arrive(ticket)
    order = drain(queue)
    # The quiet tenant, arriving behind six of the flood's, is second and fourth, not seventh and eighth.
    assert order[:4] == [flood[0], quiet[0], flood[1], quiet[1]]
    assert order[4:] == flood[2:]


def test_turns_over_three_tenants_are_round_robin() -> None:
    queue = full_queue()
    tickets = {t: [queue.ticket(t, 0) for _ in range(3)] for t in "abc"}
    for t in "abc":
        for ticket in tickets[t]:
            queue.arrive(ticket)
    assert [t.tenant for t in drain(queue)] == list("abcabcabc")


def test_a_full_queue_sheds_the_lowest_priority_newest() -> None:
    queue = full_queue(max_queued=2)
    low_old, low_new = queue.ticket("a", 0), queue.ticket("a", 0)
    queue.arrive(low_old)
    queue.arrive(low_new)
    high = queue.ticket("b", 3)
    assert queue.arrive(high).shed == [low_new]
    assert drain(queue) == [high, low_old]
    queue.check()


def test_a_full_queue_sheds_the_arrival_when_it_has_the_lowest_priority() -> None:
    queue = full_queue(max_queued=1)
    high = queue.ticket("a", 3)
    queue.arrive(high)
    low = queue.ticket("b", 0)
    assert queue.arrive(low).shed == [low]
    assert drain(queue) == [high]
    assert queue.shed == 1


def test_under_equal_priority_the_heaviest_tenant_is_shed() -> None:
    queue = full_queue(max_queued=3)
    flood = [queue.ticket("flood", 0) for _ in range(3)]
    for ticket in flood:
        queue.arrive(ticket)
    quiet = queue.ticket("quiet", 0)
    assert queue.arrive(quiet).shed == [flood[-1]]
    assert set(drain(queue)) == {flood[0], flood[1], quiet}


def test_zero_queue_sheds_everything_beyond_capacity() -> None:
    queue = FlowQueue(max_queued=0, capacity=1)
    first, second = queue.ticket("a", 0), queue.ticket("a", 0)
    assert queue.arrive(first).dispatched == [first]
    assert queue.arrive(second).shed == [second]
    queue.check()


def test_more_capacity_dispatches_waiting_requests_less_takes_nothing_back() -> None:
    queue = full_queue(capacity=1)
    waiting = [queue.ticket("a", 0) for _ in range(3)]
    for ticket in waiting:
        queue.arrive(ticket)
    assert queue.resize(3) == waiting[:2]
    assert queue.inflight == 3
    assert queue.resize(1) == []
    assert queue.inflight == 3  # in flight stays in flight
    assert queue.release() == [] and queue.release() == []
    assert queue.release() == [waiting[2]]  # below capacity again


def test_withdrawn_tickets_leave_the_queue_and_only_waiting_ones_can() -> None:
    queue = full_queue()
    gone, stays = queue.ticket("a", 0), queue.ticket("b", 0)
    queue.arrive(gone)
    queue.arrive(stays)
    assert queue.withdraw(gone)
    assert not queue.withdraw(gone)
    assert queue.release() == [stays]
    assert not queue.withdraw(stays)  # dispatched: its outcome is the caller's
    queue.check()


def test_release_without_a_request_in_flight_is_an_error() -> None:
    with pytest.raises(ValueError, match="release without"):
        FlowQueue(max_queued=1, capacity=1).release()


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_loses_nothing_and_keeps_the_order_rules(seed: int) -> None:
    """Random arrivals, releases, withdrawals and resizes: every ticket ends exactly once (dispatched, shed or
    withdrawn, or still waiting), in flight never exceeds capacity except after a shrink, and each dispatch takes
    the highest priority waiting."""
    rng = random.Random(seed)
    queue = FlowQueue(max_queued=rng.randint(0, 8), capacity=rng.randint(1, 4))
    outcomes: dict[Ticket, str] = {}
    waiting: set[Ticket] = set()
    inflight: list[Ticket] = []

    def settle(dispatched: list[Ticket], shed: list[Ticket] = ()) -> None:  # type: ignore[assignment]
        for ticket in shed:
            waiting.discard(ticket)
        for ticket in dispatched:  # in the order dispatched: each the highest priority still waiting
            top = max(t.priority for t in waiting | {ticket})
            assert ticket.priority == top, "a lower priority went before a higher one"
            waiting.discard(ticket)
        for ticket in [*dispatched, *shed]:
            assert ticket not in outcomes, f"{ticket} settled twice"
        outcomes.update({t: "dispatched" for t in dispatched})
        outcomes.update({t: "shed" for t in shed})
        inflight.extend(dispatched)

    arrived = []
    for _ in range(400):
        roll = rng.random()
        if roll < 0.5:
            ticket = queue.ticket(rng.choice("abc"), rng.choice((-1, 0, 0, 2)))
            arrived.append(ticket)
            arrival = queue.arrive(ticket)
            if not arrival.dispatched and ticket not in arrival.shed:
                waiting.add(ticket)
            elif ticket in arrival.dispatched:
                waiting.add(ticket)  # for the priority check: it competed with what was waiting
            settle(arrival.dispatched, arrival.shed)
        elif roll < 0.8 and inflight:
            inflight.pop(rng.randrange(len(inflight)))
            settle(queue.release())
        elif roll < 0.9 and waiting:
            ticket = rng.choice(sorted(waiting, key=lambda t: t.seq))
            assert queue.withdraw(ticket)
            waiting.discard(ticket)
            outcomes[ticket] = "withdrawn"
        else:
            settle(queue.resize(rng.randint(0, 5)))
        queue.check()
        assert len(queue) == len(waiting) <= queue.max_queued
        assert queue.inflight == len(inflight)
    # Everything still waiting goes once capacity comes back and the requests in flight finish.
    settle(queue.resize(2))
    while inflight:
        inflight.pop()
        settle(queue.release())
    assert not waiting and len(queue) == 0
    assert set(outcomes) == set(arrived)
    queue.check()
    assert queue.dispatched == sum(1 for o in outcomes.values() if o == "dispatched")


def test_tenant_is_the_header_else_the_api_key_id_else_anonymous() -> None:
    assert tenant_of({"x-tenant": "team-a", "authorization": "Bearer k1"}, "x-tenant") == "team-a"
    assert tenant_of({"authorization": "Bearer k1"}, "x-tenant") == key_id("k1")
    assert tenant_of({"x-api-key": "k2"}, None) == key_id("k2")
    assert tenant_of({}, None) == ANONYMOUS_TENANT
    assert "k1" not in tenant_of({"authorization": "Bearer k1"}, None)  # the key itself never becomes a label


def test_a_request_may_lower_its_priority_never_raise_it() -> None:
    assert priority_of({}, "x-loom-priority", 5) == 5
    assert priority_of({"x-loom-priority": "-3"}, "x-loom-priority", 5) == -3
    assert priority_of({"x-loom-priority": "100"}, "x-loom-priority", 5) == 5
    assert priority_of({"x-loom-priority": "high"}, "x-loom-priority", 5) == 5
