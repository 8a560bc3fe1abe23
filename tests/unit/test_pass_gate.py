"""The gate in front of every reconcile pass: bounded across kinds, an object's first pass ahead of the others, a
pass's timeout counted from its slot, a cancelled waiter never losing a slot."""

from __future__ import annotations

import asyncio

import pytest

from loom.operator.core.pass_gate import FIRST, LATER, PassGate
from loom.operator.core.runner import Runner

pytestmark = pytest.mark.timeout(30)


async def test_at_most_the_slots_run_and_first_passes_go_before_earlier_waiters() -> None:
    gate, release, order = PassGate(slots=2), asyncio.Event(), []
    running = 0

    async def work(name: str, priority: int) -> None:
        nonlocal running
        async with gate.slot(priority):
            running += 1
            order.append(name)
            assert running <= 2
            await release.wait()
            running -= 1

    holders = [asyncio.create_task(work(f"held-{i}", LATER)) for i in range(2)]
    await asyncio.sleep(0)
    later = [asyncio.create_task(work(f"later-{i}", LATER)) for i in range(2)]
    await asyncio.sleep(0)
    first = asyncio.create_task(work("first", FIRST))  # came last, a new object's first pass
    await asyncio.sleep(0.01)
    assert order == ["held-0", "held-1"] and gate.waiting == 3
    release.set()
    await asyncio.gather(*holders, *later, first)
    assert order[2] == "first" and order[3:] == ["later-0", "later-1"]


async def test_a_cancelled_waiter_gives_up_its_place_and_its_slot() -> None:
    gate = PassGate(slots=1)
    release = asyncio.Event()

    async def hold() -> None:
        async with gate.slot():
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter.cancel()
    release.set()
    await holder
    with pytest.raises(asyncio.CancelledError):
        await waiter
    async with gate.slot():  # the slot came back: nobody holds it
        assert gate.waiting == 0


async def test_a_pass_timeout_counts_from_its_slot_not_from_its_wait() -> None:
    gate, release = PassGate(slots=1), asyncio.Event()
    calls: list[str] = []

    async def reconcile(namespace: str, name: str) -> None:
        calls.append(name)
        if name == "slow":
            await release.wait()
        else:
            await asyncio.sleep(0.2)  # within its own timeout (0.5 s), not within the wait plus it
        calls.append(f"{name} done")

    runner = Runner("Thing", reconcile, interval_s=3600, timeout_s=0.5, gate=gate)
    slow = asyncio.create_task(runner.trigger("ns", "slow"))
    await asyncio.sleep(0.01)
    quick = asyncio.create_task(runner.trigger("ns", "quick"))
    await asyncio.sleep(0.45)  # the quick pass waits for the slot almost its whole timeout
    release.set()
    await asyncio.gather(slow, quick)
    assert calls == ["slow", "slow done", "quick", "quick done"]  # the quick pass ran to its end: not abandoned
