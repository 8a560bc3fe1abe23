"""The controller's two HTTP edges against the real programs: the trainer's own progress endpoint, and a
real MLflow tracking server (session fixture `mlflow` from loom.e2e.pytest_services)."""

from __future__ import annotations

import httpx
import pytest

from loom.devstack.servers import MLflowEndpoint, free_port
from loom.operator.kinds.trainingjob.observe import progress_from_metrics
from loom.operator.kinds.trainingjob.progress.io import fetch_progress, new_client
from loom.operator.kinds.trainingjob.tracking.io import JOB_UID_TAG, TrackingError, ensure_run, finish_run
from loom.workloads.trainer.config import ProgressSpec
from loom.workloads.trainer.tracking import Progress


async def test_progress_is_read_from_the_trainers_real_endpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    progress = Progress(ProgressSpec(file=str(tmp_path / "progress.json"), metrics_port=port), total_steps=100)
    progress.update(40, 1.5, 64.0, 30.0, "Running")
    progress.checkpoint_committed("s3://bucket/run/step-000000040", 40)
    async with new_client() as client:
        report = await fetch_progress(client, "127.0.0.1", "s3://bucket/run/", port=port, samples_per_step=32)
    assert report is not None
    assert (report.step, report.total_steps, report.loss, report.samples_per_second) == (40, 100, 1.5, 64.0)
    assert report.eta == "30s"  # 60 steps x 32 samples / 64 samples/s
    # The URI the operator reports is exactly the one the trainer committed.
    assert report.latest_checkpoint is not None
    assert report.latest_checkpoint.uri == "s3://bucket/run/step-000000040"
    assert report.latest_checkpoint.step == 40


async def test_unreachable_progress_is_none_not_an_error() -> None:
    async with new_client() as client:
        assert await fetch_progress(client, "127.0.0.1", None, port=free_port()) is None


def test_metrics_without_checkpoint_report_none() -> None:
    report = progress_from_metrics("loom_trainer_step 3.0\nloom_trainer_checkpoint_step 0.0\n", "s3://b/p")
    assert report is not None and report.step == 3 and report.latest_checkpoint is None
    assert progress_from_metrics("other_metric 1\n", "s3://b/p") is None


async def test_mlflow_run_is_created_once_per_job_uid(mlflow: MLflowEndpoint) -> None:
    first = await ensure_run(mlflow.url, "loom-op-test", job_uid="uid-1", job_name="gpt", namespace="ns", now_ms=1)
    again = await ensure_run(mlflow.url, "loom-op-test", job_uid="uid-1", job_name="gpt", namespace="ns", now_ms=2)
    other = await ensure_run(mlflow.url, "loom-op-test", job_uid="uid-2", job_name="gpt", namespace="ns", now_ms=3)
    assert first == again  # an operator that crashed before recording the id finds the same run
    assert other.run_id != first.run_id
    assert first.url.startswith(mlflow.url.rstrip("/") + "/#/experiments/")
    assert first.url.endswith(f"/runs/{first.run_id}")
    async with httpx.AsyncClient(base_url=mlflow.url) as client:
        run = (await client.get("/api/2.0/mlflow/runs/get", params={"run_id": first.run_id})).json()["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags[JOB_UID_TAG] == "uid-1"
    assert run["info"]["status"] == "RUNNING"
    await finish_run(mlflow.url, first.run_id, succeeded=False, now_ms=10)
    async with httpx.AsyncClient(base_url=mlflow.url) as client:
        run = (await client.get("/api/2.0/mlflow/runs/get", params={"run_id": first.run_id})).json()["run"]
    assert run["info"]["status"] == "FAILED"


async def test_unreachable_mlflow_is_a_tracking_error() -> None:
    with pytest.raises(TrackingError, match="unreachable"):
        await ensure_run(f"http://127.0.0.1:{free_port()}", "x", job_uid="u", job_name="n", namespace="ns", now_ms=1)


def test_rank_zeros_answer_stands_for_a_moment_and_only_for_the_same_pod() -> None:
    from loom.operator.kinds.trainingjob.observe import ProgressReport
    from loom.operator.kinds.trainingjob.progress.io import RecentPolls

    polls, job, rank0 = RecentPolls(reuse_s=2.0), ("ml", "gpt"), ("10.0.0.5", 1)
    report = ProgressReport(step=40)
    assert polls.fresh(job, rank0, 100.0) == (False, None)  # never asked
    polls.record(job, rank0, 100.0, report)
    assert polls.fresh(job, rank0, 101.9) == (True, report)  # the burst's next passes reuse it
    assert polls.fresh(job, rank0, 102.0) == (False, None)  # then rank 0 is asked again
    assert polls.fresh(job, ("10.0.0.9", 1), 100.5) == (False, None)  # another pod
    assert polls.fresh(job, ("10.0.0.5", 2), 100.5) == (False, None)  # the next attempt
    polls.record(("ml", "other"), rank0, 100.0, None)
    assert polls.fresh(("ml", "other"), rank0, 100.5) == (True, None)  # no answer is an answer too, for a moment
    polls.forget(job)
    polls.forget(("ml", "never-seen"))
    assert len(polls) == 1 and polls.fresh(job, rank0, 100.5) == (False, None)


def test_a_rank_zero_that_does_not_answer_is_asked_less_and_less_often() -> None:
    """A trainer still loading, or a pod that never serves (a simulated node): each pass must not wait for it."""
    from loom.operator.kinds.trainingjob.observe import ProgressReport
    from loom.operator.kinds.trainingjob.progress.io import RecentPolls

    polls, job, rank0 = RecentPolls(reuse_s=2.0, unanswered_max_s=10.0), ("ml", "gpt"), ("10.0.0.5", 1)
    now, waits = 0.0, []
    for _ in range(6):
        polls.record(job, rank0, now, None)
        wait = 0.0
        while polls.fresh(job, rank0, now + wait)[0]:
            wait += 0.5
        waits.append(wait)
        now += wait
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert polls.fresh(job, ("10.0.0.9", 2), now) == (False, None)  # a new rank 0 is asked at once
    polls.record(job, rank0, now, ProgressReport(step=3))  # an answer ends the backoff
    polls.record(job, rank0, now + 2.0, None)
    assert polls.fresh(job, rank0, now + 3.9) == (True, None) and polls.fresh(job, rank0, now + 4.0)[0] is False


def test_only_answers_the_state_machine_acts_on_are_news() -> None:
    from loom.operator.kinds.trainingjob.observe import CheckpointReport, ProgressReport, UploadRetryReport
    from loom.operator.kinds.trainingjob.progress.io import news

    running = ProgressReport(step=40, loss=1.5, phase="Running")
    assert news(None, running)  # the first answer
    assert not news(running, None)  # no answer is no news: the last one stands
    assert not news(running, ProgressReport(step=41, loss=1.4, phase="Running"))  # the periodic pass shows it
    assert news(ProgressReport(step=0, phase="Starting"), running)  # a restart waits for the trainer to resume
    checkpointed = ProgressReport(step=41, phase="Running", latest_checkpoint=CheckpointReport("s3://b/step-41", 41))
    assert news(running, checkpointed)
    assert news(checkpointed, ProgressReport(step=41, phase="Running", checkpoint_retry=UploadRetryReport(1)))


def trainer_at_step_40(tmp_path) -> tuple[Progress, int]:  # type: ignore[no-untyped-def]
    """The trainer's real progress endpoint on a free port, at step 40 of 100."""
    port = free_port()
    progress = Progress(ProgressSpec(file=str(tmp_path / "progress.json"), metrics_port=port), total_steps=100)
    progress.update(40, 1.5, 64.0, 30.0, "Running")
    return progress, port


class Triggered(list[tuple[str, str]]):
    """The passes a poller asked for, as the runner's trigger would get them."""

    async def __call__(self, namespace: str, name: str) -> None:
        self.append((namespace, name))


async def test_a_pass_reads_rank_zeros_last_answer_and_never_waits_for_a_poll(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from loom.operator.kinds.trainingjob.progress.io import ProgressPoller, RecentPolls

    progress, port = trainer_at_step_40(tmp_path)
    triggered = Triggered()
    # reuse_s=0: every read finds the last answer stale and starts a poll (when none runs).
    poller, job, rank0 = ProgressPoller(triggered, RecentPolls(reuse_s=0.0), port=port), ("ml", "gpt"), ("127.0.0.1", 1)

    async def answered(reads: int) -> None:
        while len(triggered) < reads or poller.polling:
            await asyncio.sleep(0.01)

    try:
        assert poller.latest(job, rank0, "s3://b/run/", 32) is None  # nothing yet: a poll runs meanwhile
        assert poller.polling == {job}
        assert poller.latest(job, rank0, "s3://b/run/", 32) is None and len(poller.polling) == 1  # one at a time
        await asyncio.wait_for(answered(1), 10)
        assert triggered == [job]  # the first answer: the job's pass at once
        report = poller.latest(job, rank0, "s3://b/run/", 32)
        assert report is not None and report.step == 40
        await asyncio.wait_for(answered(1), 10)  # the poll that read started

        progress.update(41, 1.4, 64.0, 30.0, "Running")  # only the step moves: no pass for it
        stale = poller.latest(job, rank0, "s3://b/run/", 32)  # the last answer, while a new poll runs
        assert stale is not None and stale.step == 40
        await asyncio.wait_for(answered(1), 10)
        report = poller.latest(job, rank0, "s3://b/run/", 32)  # the answer of the poll just done
        assert report is not None and report.step == 41 and triggered == [job]
        await asyncio.wait_for(answered(1), 10)

        progress.checkpoint_committed("s3://b/run/step-000000041", 41)  # a newer checkpoint is news
        poller.latest(job, rank0, "s3://b/run/", 32)
        await asyncio.wait_for(answered(2), 10)
        assert triggered == [job, job]
        report = poller.latest(job, rank0, "s3://b/run/", 32)
        assert report is not None and report.latest_checkpoint is not None
        assert report.latest_checkpoint.uri == "s3://b/run/step-000000041"

        assert poller.polling == {job}  # the read above started one more
        poller.forget(job)  # deleted: its answers go, its running poll is cancelled
        assert not poller.polling and len(poller.polls) == 0
    finally:
        await poller.close()


async def test_a_followed_job_is_polled_without_passes_and_any_change_of_its_answer_triggers_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from loom.operator.kinds.trainingjob.progress.io import ProgressPoller, RecentPolls

    progress, port = trainer_at_step_40(tmp_path)
    triggered = Triggered()
    poller = ProgressPoller(triggered, RecentPolls(reuse_s=0.0), port=port, interval_s=0.05)
    job, rank0 = ("ml", "gpt"), ("127.0.0.1", 1)

    async def until(condition) -> None:  # type: ignore[no-untyped-def]
        while not condition():
            await asyncio.sleep(0.01)

    try:
        poller.follow(job, rank0, "s3://b/run/", 32)  # a steady job: no pass reads its progress any more
        await asyncio.wait_for(until(lambda: len(triggered) == 1), 10)  # the first answer
        report = poller.polls.last(job, rank0)
        assert report is not None and report.step == 40
        await asyncio.sleep(0.3)  # several polls, the same answer: no pass
        assert triggered == [job]
        progress.update(41, 1.4, 64.0, 30.0, "Running")  # only the step moves: a followed job's pass shows it
        await asyncio.wait_for(until(lambda: len(triggered) == 2), 10)
        report = poller.polls.last(job, rank0)
        assert report is not None and report.step == 41
        poller.unfollow(job)  # no longer steady: its periodic passes read progress again
        progress.update(42, 1.3, 64.0, 30.0, "Running")
        await asyncio.sleep(0.3)
        assert triggered == [job, job] and poller.followed == frozenset()
        last = poller.polls.last(job, rank0)
        assert last is not None and last.step == 41  # nothing polled it since
    finally:
        await poller.close()
