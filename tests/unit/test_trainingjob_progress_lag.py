"""How far a steady TrainingJob's status progress lags the trainer (#52 part 4), measured and held.

A steady job left the periodic resync (pacing.py): the progress poller follows its rank 0 every training poll and
a changed answer triggers the pass that writes status. The promise (README, progress/io.py): status progress within
one progress-poll interval of the trainer's. The demo once printed "worker killed at step 81, resumed from the
step-90 checkpoint": status was ten steps behind. Here a real trainer progress endpoint moves one step every
STEP_S; the job's passes (the follower's triggers, and passes that other events start at any moment, as a worker
pod's or its node's watch events do) write status from the poller's answer; the lag is sampled all along."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from loom.devstack.servers import free_port
from loom.operator.kinds.trainingjob.progress.io import ProgressPoller, RecentPolls
from loom.workloads.trainer.config import ProgressSpec
from loom.workloads.trainer.tracking import Progress

pytestmark = pytest.mark.timeout(60)


def percentile(values: list[float], pct: float) -> float:
    """The lag that `pct` percent of the samples do not exceed. Not the maximum: a machine busy with other work
    (vLLM starting beside these tests) stalls this process now and then for a few hundred milliseconds, which is no
    property of the poller. Before the fixes the lag spread evenly up to two intervals (a job that was not steady)
    or an interval and the reuse (a pass's read just before the follower's tick), well above this bound."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


INTERVAL_S = 0.5  # the training poll, scaled from 5 s
REUSE_S = 0.2  # RecentPolls' reuse, scaled as the production 2 s are to 5 s
STEP_S = 0.02  # the trainer's pace: 25 steps per interval
SLACK_S = 0.2  # a poll's and a pass's own time, and late wake-ups on a busy machine (seen up to 0.15)


async def test_a_followed_jobs_status_progress_lags_the_trainer_by_at_most_one_poll_interval(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
    typical, worst = percentile(lags, 95), max(lags)
    assert typical <= INTERVAL_S + SLACK_S, (
        f"status progress lagged the trainer by {typical:.3f}s or less 95% of the time, {worst:.3f}s at worst "
        f"({worst / STEP_S:.0f} steps); one poll interval is {INTERVAL_S}s ({INTERVAL_S / STEP_S:.0f} steps); "
        f"{passes} passes"
    )


async def test_the_follower_polls_at_its_tick_even_just_after_a_pass_read_rank_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A pass's read just before the follower's tick used to make the tick skip (the answer was fresh for the
    reuse), so the next poll came a whole interval later: status lagged by the interval and the reuse."""
    port = free_port()
    progress = Progress(ProgressSpec(file=str(tmp_path / "progress.json"), metrics_port=port), total_steps=100)
    progress.update(1, 2.0, 64.0, 30.0, "Running")
    job, rank0 = ("ml", "gpt"), ("127.0.0.1", 1)

    async def nothing(namespace: str, name: str) -> None:
        pass

    interval_s, reuse_s = 0.3, 0.2
    poller = ProgressPoller(nothing, RecentPolls(reuse_s=reuse_s), port=port, interval_s=interval_s)
    answers: list[float] = []
    record = poller.polls.record

    def counted(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        answers.append(time.monotonic())
        record(*args, **kwargs)

    poller.polls.record = counted  # type: ignore[method-assign]
    try:
        started = time.monotonic()
        poller.follow(job, rank0, None, 32)  # its first tick: interval_s from now
        await asyncio.sleep(interval_s - 0.1)
        poller.latest(job, rank0, None, 32)  # a pass reads rank 0 0.1 s before the tick: fresh for 0.2 s
        await asyncio.sleep(0.2)  # past the tick, well before the next one
        assert len(answers) == 2, [round(t - started, 3) for t in answers]
    finally:
        await poller.close()


async def test_a_job_that_is_not_steady_lags_by_at_most_one_poll_interval_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
    typical, worst, elapsed = percentile(lags, 95), max(lags), time.monotonic() - started
    assert typical <= INTERVAL_S + SLACK_S, (
        f"lagged {typical:.3f}s or less 95% of the time, {worst:.3f}s at worst ({passes} passes in {elapsed:.1f}s)"
    )
    assert passes <= 2 * elapsed / INTERVAL_S + 2  # at most the follower's and the resync's


def test_pace_follows_every_job_whose_rank_0_runs_steady_or_not() -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from loom.operator.kinds.trainingjob.api import TrainingJobStatus
    from loom.operator.kinds.trainingjob.controller import Controller, Observed
    from loom.operator.kinds.trainingjob.decision import Policy

    calls: list[tuple[str, tuple[str, str]]] = []

    class Poller:
        def follow(self, job: tuple[str, str], *poll: object) -> None:
            calls.append(("follow", job))

        def unfollow(self, job: tuple[str, str]) -> None:
            calls.append(("unfollow", job))

    controller = Controller(image="trainer", policy=Policy(), progress=cast(Any, Poller()))
    ctx = cast(Any, SimpleNamespace(namespace="ml", name="gpt"))
    running = Observed(status=TrainingJobStatus(phase="Running"))
    running.rank0 = (("127.10.0.5", 1), None, 32)
    controller.pace(ctx, running, None)  # no decision: not steady
    controller.pace(ctx, Observed(status=TrainingJobStatus(phase="Pending")), None)  # no rank 0 running
    assert calls == [("follow", ("ml", "gpt")), ("unfollow", ("ml", "gpt"))]
