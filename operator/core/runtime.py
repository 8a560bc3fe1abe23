"""The operator process's runtime: Python's garbage collector tuned for one event loop holding many objects, and
that loop's lag as a metric.

Why the collector: every watch event becomes fresh dicts (the JSON), and Kopf wraps each in a Body and a Patch
that refer to each other (a reference cycle per event, only the collector frees). At CPython's default threshold
(a young collection every 700 net allocations) a burst of 200 TrainingJobs ran 1,640 young, 148 middle and 16 full
collections in two rounds; every full one walked the whole heap (the imported modules' 160,000 objects
included) and stopped the event loop for 0.3-0.6 s, every 6 s: the loop's lag p99 was 0.23 s, its max 0.83 s,
and the collector took about a third of the operator's CPU (bench/bench_kubeflow_p1.py, gc.callbacks timing).
With the start-up heap frozen and a young collection every 50,000 net allocations: 14 young collections in
those two rounds (about 0.13 s each, 1.8 s in all), no middle or full one, loop lag p99 0.085 s, per-job p50
0.59-0.70 s and p99 1.3-1.8 s instead of 0.84-1.96 and 2.4-5.2 s. Garbage still goes: a cycle made and dropped
between two young collections (Kopf's, an HTTP exchange's) is young when they run and is freed by them.
"""

from __future__ import annotations

import asyncio
import gc

from prometheus_client import Histogram

# Net allocations of container objects between two young collections (CPython's default: 700). Larger means
# fewer collections and less CPU in all, but a longer stop of the loop each time (about 0.13 s at 50,000 on a busy
# 2-core machine; 20,000 took 0.075 s each but 45% more in all, measured the same way).
YOUNG_THRESHOLD = 50_000
# Young collections per middle one, middle per full one (a full one still also waits for the long-lived objects
# to have grown by a quarter, CPython's own rule).
MIDDLE_THRESHOLD = 20
FULL_THRESHOLD = 10

LOOP_LAG = Histogram(
    "loom_operator_event_loop_lag_seconds",
    "How late the operator's event loop woke a task that slept: the wait every watch event and pass adds.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
LAG_PROBE_S = 0.25


def tune_garbage_collector() -> tuple[int, int, int]:
    """Collect once, freeze what start-up made (modules, classes, registered handlers: never garbage, never walked
    again), then collect the young generation less often. Call once, after the imports and the handlers'
    registration, before the event loop starts. Returns the thresholds set."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, FULL_THRESHOLD)
    return gc.get_threshold()


async def measure_loop_lag(probe_s: float = LAG_PROBE_S, histogram: Histogram = LOOP_LAG) -> None:
    """Forever: sleep `probe_s`, and observe how much later than asked the loop woke this task."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + probe_s
        await asyncio.sleep(probe_s)
        histogram.observe(max(0.0, loop.time() - asked))
