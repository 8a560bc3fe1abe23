"""How far a TrainingJob's status progress lags its trainer (#52 part 4): measured, printed, not asserted.

A real trainer progress endpoint moves one step every STEP_S; the job's passes (the progress follower's triggers,
and passes other events start at any moment, or the resync's rounds for a job that is not steady) write status from
the poller's answer; the lag (trainer step - status step, in seconds) is sampled for a few seconds. The promise
(docs, progress/io.py): within one progress-poll interval. Before the fix (#52) the lag spread up to two intervals
(a job that was not steady) or an interval plus the reuse window (a pass's read just before the follower's tick);
tests/unit/test_trainingjob_progress_lag.py holds the two causes without a clock. Times are scaled: a 0.5 s
interval for the production 5 s.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_progress_lag.py
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from loom.devstack.servers import free_port
from loom.operator.kinds.trainingjob.progress.io import ProgressPoller, RecentPolls
from loom.workloads.trainer.config import ProgressSpec
from loom.workloads.trainer.tracking import Progress


def percentile(values: list[float], pct: float) -> float:
    """The lag that `pct` percent of the samples do not exceed. Not the maximum: a machine busy with other work
    stalls this process now and then for a few hundred milliseconds, which is no property of the poller."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


INTERVAL_S = 0.5  # the training poll, scaled from 5 s
REUSE_S = 0.2  # RecentPolls' reuse, scaled as the production 2 s are to 5 s
STEP_S = 0.02  # the trainer's pace: 25 steps per interval


class Job:
    """A job whose rank 0 runs a real progress endpoint moving one step every STEP_S, and the status its passes
    write from the poller's answer (what the controller's pass does with progress)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.progress = Progress(ProgressSpec(file=str(folder / "progress.json"), metrics_port=port), 100_000)
        self.progress.update(0, 2.0, 64.0, 30.0, "Running")
        self.key, self.rank0 = ("ml", "gpt"), ("127.0.0.1", 1)
        self.poller = ProgressPoller(self.a_pass, RecentPolls(reuse_s=REUSE_S), port=port, interval_s=INTERVAL_S)
        self.status_step, self.last_pass, self.passes = -1, float("-inf"), 0
        self.started = time.monotonic()

    async def a_pass(self, namespace: str, name: str) -> None:
        self.passes += 1
        report = self.poller.latest(self.key, self.rank0, None, 32)
        if report is not None:
            self.status_step = report.step
        self.last_pass = time.monotonic()

    def trainer_step(self) -> int:
        return int((time.monotonic() - self.started) / STEP_S)

    async def train(self) -> None:
        while True:
            self.progress.update(self.trainer_step(), 1.0, 64.0, 30.0, "Running")
            await asyncio.sleep(STEP_S / 2)


async def other_events(job: Job) -> None:
    """A steady job's passes no poll asked for: a worker pod's status, its node's heartbeat."""
    rng = random.Random(52)
    while True:
        await asyncio.sleep(rng.uniform(0.1, 0.8))
        await job.a_pass(*job.key)


async def resync(job: Job) -> None:
    """A job that is not steady (a deadline, an MLflow run not ready...): the runner's rounds, at their own phase,
    leaving it alone when its last pass ended less than half an interval before (core/runner.py's resync_order)."""
    await asyncio.sleep(INTERVAL_S * 0.37)
    while True:
        if time.monotonic() - job.last_pass >= INTERVAL_S / 2:
            await job.a_pass(*job.key)
        await asyncio.sleep(INTERVAL_S)


async def lag(folder: Path, passes_besides: Callable[[Job], Awaitable[None]]) -> tuple[float, float, int]:
    """The job followed (what controller.pace does for every job whose rank 0 runs), other passes beside: the lag
    at p95 and at worst over 4 s, and the passes made."""
    job = Job(folder)
    tasks = [asyncio.create_task(job.train()), asyncio.create_task(passes_besides(job))]
    try:
        job.poller.follow(job.key, job.rank0, None, 32)
        while job.status_step < 0:
            await asyncio.sleep(0.005)
        lags: list[float] = []
        until = time.monotonic() + 4.0
        while time.monotonic() < until:
            lags.append((job.trainer_step() - job.status_step) * STEP_S)
            await asyncio.sleep(0.005)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await job.poller.close()
    return percentile(lags, 95), max(lags), job.passes


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for label, besides in (("followed (steady) job", other_events), ("job that is not steady", resync)):
            typical, worst, passes = await lag(Path(folder) / label.split()[0], besides)
            print(f"{label}: status lags the trainer by {typical:.3f} s at p95 ({typical / INTERVAL_S:.2f} of the "
                  f"poll interval), {worst:.3f} s at worst ({worst / INTERVAL_S:.2f}); {passes} passes")


if __name__ == "__main__":
    asyncio.run(main())
