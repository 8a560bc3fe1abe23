"""The controller's two HTTP edges against the real programs: the trainer's own progress endpoint, and a
real MLflow tracking server (session fixture `mlflow` from loom.e2e.pytest_services)."""

from __future__ import annotations

import httpx
import pytest

from loom.devstack.servers import MLflowEndpoint, free_port
from loom.operator.kinds.trainingjob.mlflow import JOB_UID_TAG, TrackingError, ensure_run, finish_run
from loom.operator.kinds.trainingjob.observe import progress_from_metrics
from loom.operator.kinds.trainingjob.progress import fetch_progress, new_client
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
    from loom.operator.kinds.trainingjob.progress import RecentPolls

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
    from loom.operator.kinds.trainingjob.progress import RecentPolls

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
