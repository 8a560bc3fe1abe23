"""Holding requests while the service has no Ready replica, and waking it (no HTTP, no Kubernetes here).

A request that finds a Ready endpoint goes on at once. Otherwise it is held: admitted only under both caps
(held requests, held body bytes: the activator's memory stays bounded whatever the burst), then it waits for the
first Ready endpoint until its deadline (arrival + the configured bound). While anything is held and nothing is
Ready, one wake loop asks for a replica (the `Waker`: a no-op unless the service is at zero) and asks again every
few seconds, so a wake lost to an API error, or a scale to zero racing the wake, cannot strand held requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from .metrics import ActivatorMetrics
from .targets import Targets

log = logging.getLogger("loom.workloads.activator")

# How often the wake loop asks again while requests are held and no replica is Ready.
WAKE_RETRY_S = 2.0


class Refused(Exception):
    """The request cannot be held (caps) or waited past its bound: answer 503 with Retry-After."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome
        self.message = message


class Waker(Protocol):
    async def wake(self) -> bool:
        """Ask for a replica if the service is at zero; True when it did ask."""
        ...


class Holder:
    def __init__(
        self,
        targets: Targets,
        waker: Waker,
        metrics: ActivatorMetrics,
        *,
        max_held: int,
        max_held_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = targets
        self.waker = waker
        self.metrics = metrics
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.held = 0
        self.held_bytes = 0
        self._clock = clock
        self._wake_task: asyncio.Task[None] | None = None

    def admits(self, size: int) -> bool:
        """Whether one more request of `size` body bytes may be held now (pure check of both caps)."""
        return self.held < self.max_held and self.held_bytes + size <= self.max_held_bytes

    def _count(self, requests: int, size: int) -> None:
        self.held += requests
        self.held_bytes += size
        self.metrics.held.labels(self.metrics.service).set(self.held)
        self.metrics.held_bytes.labels(self.metrics.service).set(self.held_bytes)

    async def target(self, size: int, deadline: float) -> tuple[str, bool]:
        """A Ready endpoint for a request of `size` body bytes, and whether it had to be held for it.

        Raises Refused('overloaded') when a cap is reached and Refused('timeout') at `deadline` (clock time).
        """
        endpoint = self.targets.pick()
        if endpoint is not None:
            return endpoint, False
        if not self.admits(size):
            raise Refused(
                "overloaded", f"{self.held} requests ({self.held_bytes} bytes) already held while the service wakes"
            )
        started = self._clock()
        self._count(1, size)
        try:
            self._ensure_waking()
            while True:
                if not await self.targets.wait(deadline - self._clock()):
                    raise Refused("timeout", "no replica became ready in time")
                endpoint = self.targets.pick()
                if endpoint is not None:
                    return endpoint, True
        finally:
            self._count(-1, -size)
            self.metrics.hold_latency.labels(self.metrics.service).observe(self._clock() - started)

    def _ensure_waking(self) -> None:
        if self._wake_task is None or self._wake_task.done():
            self._wake_task = asyncio.get_running_loop().create_task(self._wake_loop())

    async def _wake_loop(self) -> None:
        asked_at: float | None = None
        while self.held > 0 and not self.targets.endpoints:
            try:
                if await self.waker.wake():
                    self.metrics.wakes.labels(self.metrics.service).inc()
                    asked_at = asked_at if asked_at is not None else self._clock()
                    log.info("asked for a replica (%d request(s) held)", self.held)
            except Exception as exc:  # the API refused or is unreachable: held requests wait; ask again soon
                log.warning("waking the service failed: %s; retrying in %gs", exc, WAKE_RETRY_S)
            await self.targets.wait(WAKE_RETRY_S)
        if asked_at is not None and self.targets.endpoints:
            seconds = self._clock() - asked_at
            self.metrics.wake_latency.labels(self.metrics.service).observe(seconds)
            log.info("a replica is ready %.2fs after the wake", seconds)

    async def aclose(self) -> None:
        task, self._wake_task = self._wake_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
