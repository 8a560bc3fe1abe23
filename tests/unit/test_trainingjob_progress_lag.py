"""Why a TrainingJob's status progress lagged its trainer (#52 part 4), held without a clock's verdict; the lag itself
is measured in bench/bench_progress_lag.py (printed, not asserted: tests make no timing assertions).

A steady job left the periodic resync (pacing.py): the progress poller follows its rank 0 every training poll and
a changed answer triggers the pass that writes status. The promise (docs, progress/io.py): status progress within
one progress-poll interval of the trainer's. The demo once printed "worker killed at step 81, resumed from the
step-90 checkpoint": status was ten steps behind. The two causes: the follower skipped its tick when a pass had
just read rank 0 (held below), and a job that was not steady was not followed at all (controller.pace, below)."""

from __future__ import annotations

import asyncio
import time

import pytest

from loom.devstack.servers import free_port
from loom.operator.kinds.trainingjob.progress.io import ProgressPoller, RecentPolls
from loom.workloads.trainer.config import ProgressSpec
from loom.workloads.trainer.tracking import Progress

pytestmark = pytest.mark.timeout(60)


async def test_the_follower_polls_at_its_tick_even_just_after_a_pass_read_rank_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A pass's read just before the follower's tick used to make the tick skip (the answer was fresh for the
    reuse), so the next poll came a whole interval later: status lagged by the interval and the reuse."""
    port = free_port()
    progress = Progress(ProgressSpec(file=str(tmp_path / "progress.json"), metrics_port=port), total_steps=100)
    progress.update(1, 2.0, 64.0, 30.0, "Running")
    job, rank0 = ("ml", "gpt"), ("127.0.0.1", 1)

    async def nothing(namespace: str, name: str) -> None:
        pass

    # Wide margins, so a busy machine's stalls (a poll's answer arriving late) cannot decide it: the tick at 1.0 s
    # must poll although the pass's read at 0.9 s is fresh until 1.7 s; the skipping follower polled next at 2.0 s.
    interval_s, reuse_s = 1.0, 0.8
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
        poller.latest(job, rank0, None, 32)  # a pass reads rank 0 0.1 s before the tick: fresh for 0.8 s
        deadline = started + interval_s + 0.7  # the tick's answer, well before the next tick
        while len(answers) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(answers) >= 2, [round(t - started, 3) for t in answers]
    finally:
        await poller.close()


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
