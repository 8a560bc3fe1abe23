"""The operator process's runtime (operator/core/runtime.py): the collector's tuning and the loop-lag probe."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram

from loom.operator.core import runtime


@pytest.fixture
def collector_restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("collector_restored")
def test_start_up_objects_are_frozen_and_young_collections_are_rarer() -> None:
    class Survivor:  # a start-up object: frozen, so no later collection walks it
        pass

    kept = Survivor()
    assert runtime.tune_garbage_collector() == (50_000, 20, 10)
    assert gc.get_threshold() == (runtime.YOUNG_THRESHOLD, runtime.MIDDLE_THRESHOLD, runtime.FULL_THRESHOLD)
    assert gc.get_freeze_count() > 0
    assert kept not in gc.get_objects(generation=2)  # frozen objects are in no generation

    # A cycle made after start-up is still garbage the collector frees.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_a_blocked_event_loop_shows_as_lag() -> None:
    histogram = Histogram("lag_seconds", "test", registry=CollectorRegistry(), buckets=(0.05, 1))

    async def block_the_loop() -> None:
        probe = asyncio.create_task(runtime.measure_loop_lag(probe_s=0.01, histogram=histogram))
        await asyncio.sleep(0)  # the probe starts its first sleep
        time.sleep(0.2)  # what a long garbage collection or a synchronous call does to every task
        await asyncio.sleep(0.05)
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)

    asyncio.run(block_the_loop())
    samples = {s.name: s.value for s in histogram.collect()[0].samples if not s.labels.get("le")}
    assert samples["lag_seconds_count"] >= 2
    assert samples["lag_seconds_sum"] >= 0.19  # the probe woke at least 0.19 s late once
