"""How many reconcile passes run at once, across every kind, and which waiting pass goes first.

Every pass talks to the API server through one client holding KUBE_CONNECTIONS connections (client.py). In a burst
(1,000 TrainingJobs and 1,000 InferenceServices created in two minutes, their 4,000 pods' events on top) thousands
of passes started at once and queued for those connections inside aiohttp, each pass's clock (reconcile_timeout_s)
running while it queued: 3,198 passes were abandoned after 120 s without having sent a request, and a new
InferenceService's first pass came 16 minutes after its creation (bench/bench_steady_requests.py, 2026-11-26). So a
pass waits for a slot before it starts, its timeout counts from there, and a pass that started finishes its writes.
Among waiting passes an object's first one (one the runner has not reconciled yet: it has no status at all) goes
before the others (a child's event, the resync), then each in the order it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

# Passes running at once: a pass mostly waits on one API call at a time, a few at once when it creates children
# (the client holds four connections per slot, client.KUBE_CONNECTIONS).
PASS_SLOTS = 32
FIRST, LATER = 0, 1  # the priorities of waiting passes, lowest first


class PassGate:
    def __init__(self, slots: int = PASS_SLOTS) -> None:
        self._free = slots
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        """Passes waiting for a slot (cancelled ones aside); walks the queue: for tests and reports, not per pass."""
        return sum(1 for _, _, future in self._waiting if not future.done())

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = LATER) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        # A free slot means nobody live is waiting: a released slot goes to a live waiter before it is counted free.
        if self._free > 0:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # handed a slot just as it was cancelled: pass the slot on
            raise

    def _release(self) -> None:
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():  # a cancelled waiter's future is done: skipped
                future.set_result(None)
                return
        self._free += 1


GATE = PassGate()
