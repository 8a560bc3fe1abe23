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


async def followed_job(tmp_path: Path) -> tuple[float, float, int]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = free_port()
    progress = Progress(ProgressSpec(file=str(tmp_path / "progress.json"), metrics_port=port), total_steps=100_000)
    progress.update(0, 2.0, 64.0, 30.0, "Running")
    job, rank0 = ("ml", "gpt"), ("127.0.0.1", 1)
    status_step = -1  # what the job's status shows (the last pass's write)
    passes = 0

    async def a_pass(namespace: str, name: str) -> None:  # what the controller's pass does with progress
        nonlocal status_step, passes
        passes += 1
        report = poller.latest(job, rank0, None, 32)
        if report is not None:
            status_step = report.step

    poller = ProgressPoller(a_pass, RecentPolls(reuse_s=REUSE_S), port=port, interval_s=INTERVAL_S)
    started = time.monotonic()

    def trainer_step() -> int:
        return int((time.monotonic() - started) / STEP_S)

    async def train() -> None:
        while True:
            progress.update(trainer_step(), 1.0, 64.0, 30.0, "Running")
            await asyncio.sleep(STEP_S / 2)

    async def other_events() -> None:  # passes no poll asked for: a worker pod's status, its node's heartbeat
        rng = random.Random(52)
        while True:
            await asyncio.sleep(rng.uniform(0.1, 0.8))
            await a_pass(*job)

    tasks = [asyncio.create_task(train()), asyncio.create_task(other_events())]
    try:
        poller.follow(job, rank0, None, 32)
        while status_step < 0:
            await asyncio.sleep(0.005)
        lags: list[float] = []
        until = time.monotonic() + 4.0
        while time.monotonic() < until:
            lags.append((trainer_step() - status_step) * STEP_S)
            await asyncio.sleep(0.005)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await poller.close()
    return percentile(lags, 95), max(lags), passes


async def not_steady_job(tmp_path: Path) -> tuple[float, float, int]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    """A job the resync still visits every interval (not steady: a deadline, an MLflow run not ready...) used to
    show the answer of the poll its previous pass had started: up to two intervals behind. It is followed too now
    (controller.pace), and the resync leaves it alone when its last pass ended less than half an interval before,
    as core/runner.py's resync_order does."""
    port = free_port()
    progress = Progress(ProgressSpec(file=str(tmp_path / "progress.json"), metrics_port=port), total_steps=100_000)
    progress.update(0, 2.0, 64.0, 30.0, "Running")
    job, rank0 = ("ml", "gpt"), ("127.0.0.1", 1)
    status_step, last_pass, passes = -1, float("-inf"), 0

    async def a_pass(namespace: str, name: str) -> None:
        nonlocal status_step, last_pass, passes
        passes += 1
        report = poller.latest(job, rank0, None, 32)
        if report is not None:
            status_step = report.step
        last_pass = time.monotonic()

    poller = ProgressPoller(a_pass, RecentPolls(reuse_s=REUSE_S), port=port, interval_s=INTERVAL_S)
    started = time.monotonic()

    def trainer_step() -> int:
        return int((time.monotonic() - started) / STEP_S)

    async def train() -> None:
        while True:
            progress.update(trainer_step(), 1.0, 64.0, 30.0, "Running")
            await asyncio.sleep(STEP_S / 2)

    async def resync() -> None:  # the runner's rounds, at their own phase
        await asyncio.sleep(INTERVAL_S * 0.37)
        while True:
            if time.monotonic() - last_pass >= INTERVAL_S / 2:
                await a_pass(*job)
            await asyncio.sleep(INTERVAL_S)

    tasks = [asyncio.create_task(train()), asyncio.create_task(resync())]
    try:
        poller.follow(job, rank0, None, 32)  # what controller.pace now does for every job whose rank 0 runs
        while status_step < 0:
            await asyncio.sleep(0.005)
        lags: list[float] = []
        until = time.monotonic() + 4.0
        while time.monotonic() < until:
            lags.append((trainer_step() - status_step) * STEP_S)
            await asyncio.sleep(0.005)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await poller.close()
    return percentile(lags, 95), max(lags), passes


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for label, run in (("followed (steady) job", followed_job), ("job that is not steady", not_steady_job)):
            typical, worst, passes = await run(Path(folder) / label.split()[0])
            print(f"{label}: status lags the trainer by {typical:.3f} s at p95 ({typical / INTERVAL_S:.2f} of the "
                  f"poll interval), {worst:.3f} s at worst ({worst / INTERVAL_S:.2f}); {passes} passes")


if __name__ == "__main__":
    asyncio.run(main())
