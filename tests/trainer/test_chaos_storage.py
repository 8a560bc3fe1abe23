"""Chaos: storage faults under the real trainer (loom.e2e.chaos.storage), against real S3 and MLflow servers.

Test scale: 2 kills in one run, 5 s outages; `make chaos` runs 20 kills and 20 s outages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.chaos.storage import kill_during_upload, mlflow_outage, s3_outage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_rank_killed_during_checkpoint_upload_never_resumes_torn_nor_loses_more_than_one_interval(
    s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    figures = kill_during_upload(s3, bucket, tmp_path, kills=2, seed=15)
    assert figures["problems"] == [], figures
    assert figures["kills"] == 2
    assert figures["resumed_from_checkpoint_being_written"] + figures["resumed_from_previous_checkpoint"] == 2


def test_s3_down_during_training_training_steps_on_and_the_next_checkpoint_lands_after_it_returns(
    s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    figures = s3_outage(s3, bucket, tmp_path, down_s=5)
    assert figures["problems"] == [], figures
    assert figures["connections_reset"] > 0  # the trainer did try S3 while it was down
    assert figures["first_commit_after_s3_returned"] >= figures["down_at_step"]


def test_mlflow_down_during_training_training_steps_on_and_tracking_catches_up(
    s3: S3Endpoint, mlflow: MLflowEndpoint, bucket: str, tmp_path: Path
) -> None:
    figures = mlflow_outage(s3, mlflow, bucket, tmp_path, down_s=5, max_steps=60)
    assert figures["problems"] == [], figures
    assert figures["connections_reset"] > 0
    assert figures["steps_logged"] == 60  # every step's loss, those logged while it was down included
