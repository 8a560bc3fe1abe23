"""Chaos: storage faults under the real trainer (loom.e2e.chaos.storage), against real S3 and MLflow servers.

Test scale: 1 kill in one run, 5 s outages; `make chaos` runs 20 kills and 20 s outages.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.chaos.storage import kill_during_upload, mlflow_outage, s3_outage
from loom.workloads.trainer.config import MLflowSpec
from loom.workloads.trainer.tracking import MLflowTracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_rank_killed_during_checkpoint_upload_never_resumes_torn_nor_loses_more_than_one_interval(
    s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    figures = kill_during_upload(s3, bucket, tmp_path, kills=1, seed=15)
    print(f"rank killed during checkpoint upload: {figures}")
    assert figures["problems"] == [], figures
    assert figures["kills"] == 1
    assert figures["resumed_from_checkpoint_being_written"] + figures["resumed_from_previous_checkpoint"] == 1


def test_s3_down_during_training_training_steps_on_and_the_next_checkpoint_lands_after_it_returns(
    s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    figures = s3_outage(s3, bucket, tmp_path, down_s=5)
    print(f"S3 outage: {figures}")
    assert figures["problems"] == [], figures
    assert figures["connections_reset"] > 0  # the trainer did try S3 while it was down
    assert figures["first_commit_after_s3_returned"] >= figures["down_at_step"]
    # The signal the operator's CheckpointStorage condition is made of: failed attempts, by error class.
    assert figures["failed_attempts_reported"] > 0 and figures["retry_events"] > 0
    assert figures["last_error_reported"] and "://" not in figures["last_error_reported"]


def test_mlflow_down_during_training_training_steps_on_and_tracking_catches_up(
    s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, tmp_path: Path
) -> None:
    figures = mlflow_outage(s3, mlflow, bucket, tmp_path, down_s=5, max_steps=60)
    print(f"MLflow outage: {figures}")
    assert figures["problems"] == [], figures
    assert figures["connections_reset"] > 0
    assert figures["steps_logged"] == 60  # every step's loss, those logged while it was down included


class _FlakyMLflow:
    """An MlflowClient stand-in that fails while `down`."""

    def __init__(self) -> None:
        self.down = True
        self.metrics: list[tuple[str, int]] = []
        self.tags: dict[str, str] = {}

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("connection reset by peer")

    def log_batch(self, run_id: str, metrics: list[Any]) -> None:
        self._check()
        self.metrics += [(m.key, m.step) for m in metrics]

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._check()
        self.tags[key] = value

    def set_terminated(self, run_id: str, status: str) -> None:
        self._check()


def test_tracker_queues_while_mlflow_is_unreachable_and_sends_everything_once_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    tracker = MLflowTracker(MLflowSpec(tracking_uri="http://127.0.0.1:9"), run_id="run-1")
    fake = _FlakyMLflow()
    tracker.client = fake  # type: ignore[assignment]
    for step in range(1, 4):
        tracker.log_metrics({"loss": 1.0 / step}, step)  # never raises, whatever MLflow does
    tracker.set_tag("loom.checkpoint.latest", "s3://b/step-3")
    assert tracker.flush() is False and len(tracker.pending) == 3 and fake.metrics == []
    fake.down = False
    assert tracker.flush() is True
    assert fake.metrics == [("loss", 1), ("loss", 2), ("loss", 3)]
    assert fake.tags == {"loom.checkpoint.latest": "s3://b/step-3"} and tracker.pending == []
    tracker.end("FINISHED")


def test_tracker_drops_the_oldest_metrics_past_its_bound_and_counts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setattr(MLflowTracker, "MAX_PENDING", 5)
    tracker = MLflowTracker(MLflowSpec(tracking_uri="http://127.0.0.1:9"), run_id="run-1")
    fake = _FlakyMLflow()
    tracker.client = fake  # type: ignore[assignment]
    for step in range(1, 9):
        tracker.log_metrics({"loss": 0.5}, step)
    assert tracker.lost == 3
    fake.down = False
    tracker.end("FINISHED")
    assert [step for _, step in fake.metrics] == [4, 5, 6, 7, 8]


def test_an_outage_outlasting_the_training_is_waited_for_a_bounded_while_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setattr(MLflowTracker, "FINAL_FLUSH_S", 10.0)
    tracker = MLflowTracker(MLflowSpec(tracking_uri="http://127.0.0.1:9"), run_id="run-1")
    fake = _FlakyMLflow()
    tracker.client = fake  # type: ignore[assignment]
    for step in range(1, 4):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    threading.Timer(1.5, lambda: setattr(fake, "down", False)).start()  # MLflow returns after training ended
    tracker.end("FINISHED")
    assert [step for _, step in fake.metrics] == [1, 2, 3] and tracker.pending == []


def test_an_outage_longer_than_the_final_wait_gives_up_and_keeps_what_was_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setattr(MLflowTracker, "FINAL_FLUSH_S", 1.5)
    tracker = MLflowTracker(MLflowSpec(tracking_uri="http://127.0.0.1:9"), run_id="run-1")
    fake = _FlakyMLflow()
    tracker.client = fake  # type: ignore[assignment]
    tracker.log_metrics({"loss": 1.0}, 1)
    tracker.end("FINISHED")  # returns: the job's end is never held hostage by MLflow
    assert fake.metrics == [] and len(tracker.pending) == 1
