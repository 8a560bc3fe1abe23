"""The picker pods' leader election (workloads/picker/election.py) on values: a fake clock per pod and a Lease store
that refuses a write whose resourceVersion is stale, as the API server does. When a pod takes the Lease, renews it,
stops leading on its own, takes over from a silent leader (never before the duration, on its own clock), and after a
release at once."""

from __future__ import annotations

from typing import Any

import pytest

from loom.workloads.picker.election import Election, LeaseState, Write, lease_object, lease_state

DURATION, DEADLINE = 15.0, 10.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class LeaseStore:
    """One Lease, as the API server keeps it: every accepted write bumps the resourceVersion; a write carrying an
    older one is refused (409)."""

    def __init__(self) -> None:
        self.version = 1
        self.body: dict[str, Any] = {"metadata": {"name": "chat-picker", "resourceVersion": "1"}, "spec": {}}
        self.stamp = 0

    def read(self) -> dict[str, Any]:
        return self.body

    def write(self, write: Write) -> bool:
        if write.version != self.body["metadata"]["resourceVersion"]:
            return False
        self.stamp += 1
        self.version += 1
        self.body = lease_object(self.body, write, f"2026-11-29T03:00:{self.stamp:02d}.000000Z")
        self.body["metadata"]["resourceVersion"] = str(self.version)
        return True


def step(election: Election, store: LeaseStore) -> bool:
    """One look of one pod (what lease.py's loop does): read, plan, write; returns whether it leads after."""
    write = election.plan(lease_state(store.read()))
    if write is not None:
        election.written(store.write(write))
    return election.leading()


def pods() -> tuple[Clock, Election, Clock, Election, LeaseStore]:
    clock_a, clock_b = Clock(), Clock(5000.0)  # the pods' clocks need not agree
    return (clock_a, Election("a", DURATION, DEADLINE, clock_a), clock_b, Election("b", DURATION, DEADLINE, clock_b),
            LeaseStore())


def advance(seconds: float, *clocks: Clock) -> None:
    for clock in clocks:
        clock.now += seconds


def test_the_first_pod_takes_a_free_lease_and_the_other_stands_by() -> None:
    clock_a, a, clock_b, b, store = pods()
    assert not a.leading() and not b.leading()
    assert step(a, store)
    spec = store.read()["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"], spec["leaseDurationSeconds"]) == ("a", 1, 15)
    assert spec["acquireTime"] == spec["renewTime"]
    assert not step(b, store)
    # a renews every 2 s: the record keeps changing, so b never takes it, however long it watches.
    for _ in range(30):
        advance(2, clock_a, clock_b)
        assert step(a, store)
        assert not step(b, store)
    assert store.read()["spec"]["holderIdentity"] == "a"
    assert store.read()["spec"]["leaseTransitions"] == 1  # renewals are not new terms


def test_a_silent_leader_is_replaced_after_the_duration_on_the_standbys_own_clock() -> None:
    _clock_a, a, clock_b, b, store = pods()
    step(a, store)
    step(b, store)  # b first sees a's record now
    # a is gone (its pod killed): b waits a full duration from when it saw the last change, not from renewTime.
    advance(DURATION - 0.5, clock_b)
    assert not step(b, store)
    advance(0.5, clock_b)
    assert step(b, store)
    spec = store.read()["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 2)


def test_a_leader_that_cannot_renew_stops_leading_before_anyone_may_take_over() -> None:
    clock_a, a, clock_b, b, store = pods()
    step(a, store)
    step(b, store)
    # From now on a's renewals fail (the API server unreachable from a's node, or refusing).
    advance(DEADLINE - 0.1, clock_a, clock_b)
    assert a.plan(lease_state(store.read())) is not None
    a.written(False)
    assert a.leading()  # still within the renew deadline of its last successful write
    advance(0.1, clock_a, clock_b)
    assert not a.leading()  # stopped serving at the deadline...
    assert not step(b, store)  # ...while b may not take over before the duration
    advance(DURATION - DEADLINE, clock_b)
    assert step(b, store)


def test_of_two_pods_taking_at_once_one_wins() -> None:
    _clock_a, a, _clock_b, b, store = pods()
    state = lease_state(store.read())
    write_a, write_b = a.plan(state), b.plan(state)  # both read the free Lease
    assert write_a is not None and write_b is not None and write_a.acquire and write_b.acquire
    a.written(store.write(write_a))
    b.written(store.write(write_b))  # stale resourceVersion: refused
    assert a.leading() and not b.leading()
    assert not step(b, store)  # and it now sees a as the holder


def test_a_released_lease_is_taken_at_the_next_look() -> None:
    _clock_a, a, clock_b, b, store = pods()
    step(a, store)
    step(b, store)
    release = a.release(lease_state(store.read()))
    assert release is not None and not a.leading()
    assert store.write(release)
    spec = store.read()["spec"]
    assert spec["holderIdentity"] is None and spec["leaseDurationSeconds"] == 1
    advance(2, clock_b)
    assert step(b, store)
    assert b.release(LeaseState("a", None, 15, 3, "9")) is None  # a pod that does not hold it releases nothing


def test_a_pod_that_lost_the_lease_knows_it_at_once() -> None:
    _clock_a, a, _clock_b, _b, store = pods()
    step(a, store)
    store.body["spec"]["holderIdentity"] = "b"  # taken over while a was cut off (b's write)
    store.body["spec"]["renewTime"] = "later"
    assert not step(a, store)


def test_the_renew_deadline_must_be_shorter_than_the_duration() -> None:
    with pytest.raises(ValueError, match="shorter"):
        Election("a", duration_s=10, renew_deadline_s=10)


def test_the_lease_written_keeps_the_read_version_as_precondition() -> None:
    current = {"metadata": {"name": "x", "resourceVersion": "7", "ownerReferences": [{"uid": "u"}]},
               "spec": {"holderIdentity": "a", "leaseTransitions": 4, "acquireTime": "t0"}}
    renewal = lease_object(current, Write("a", 15, False, 4, "7"), "t1")
    assert renewal["metadata"] == current["metadata"]  # the owner kept, the precondition the version read
    assert renewal["spec"] == {"holderIdentity": "a", "leaseTransitions": 4, "acquireTime": "t0",
                               "leaseDurationSeconds": 15, "renewTime": "t1"}
    taken = lease_object(current, Write("b", 15, True, 5, "7"), "t2")
    assert (taken["spec"]["acquireTime"], taken["spec"]["leaseTransitions"]) == ("t2", 5)
    assert lease_state({"metadata": {"resourceVersion": "3"}}) == LeaseState("", None, None, 0, "3")
