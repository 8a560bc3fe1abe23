"""Reading every replica's /metrics on a period (the I/O around engine_metrics.parse)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from .engine_metrics import parse
from .state import PickerState

log = logging.getLogger("loom.workloads.picker.poll")


async def poll_once(state: PickerState, session: aiohttp.ClientSession) -> None:
    async def one(endpoint: str) -> None:
        try:
            async with session.get(f"http://{endpoint}/metrics") as response:
                if response.status == 200 and (load := parse(await response.text())) is not None:
                    state.observe(endpoint, load)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("metrics of %s unread: %s", endpoint, exc)  # its last load stands until the next poll

    await asyncio.gather(*(one(e) for e in list(state.pods)))


# A replica busy decoding can take seconds to answer /metrics (its engine shares the CPU or the front with the
# work), and that is when its load matters most: a read cut short leaves the last (idle) load standing.
MIN_READ_TIMEOUT_S = 5.0


async def poll_forever(state: PickerState, interval_s: float) -> None:
    timeout = aiohttp.ClientTimeout(total=max(MIN_READ_TIMEOUT_S, 4 * interval_s))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            await poll_once(state, session)
            await asyncio.sleep(interval_s)
