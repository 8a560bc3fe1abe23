"""The TrainingJob's CheckpointStorage condition (pure): is checkpoint storage taking the checkpoints?

Training never waits on S3: while an upload fails the trainer steps on and botocore retries it, so without a
condition an outage is invisible until a restart finds the newest checkpoint old. The trainer reports every
failed S3 attempt in its progress document (`checkpointRetry`, until the next commit; see
workloads/trainer/checkpoint/retries.py), and this condition says so:

- False `UploadRetrying` while the trainer reports failed attempts: how many, since when, the error's class;
- True `Uploaded` once a checkpoint is committed and the trainer reports no failure, or a newer checkpoint is
  known (the final one, named by the trainer's exit message after the last poll);
- absent until the first checkpoint or failure: a job that has not saved yet has nothing to say.

The trainer's words reach status: only an identifier-like error name and a timestamp-like `since` pass, so
neither a URL nor a credential can ride along.
"""

from __future__ import annotations

import re

from ...core.model import Condition
from .api import CheckpointStatus
from .observe import ProgressReport, UploadRetryReport

CONDITION = "CheckpointStorage"
RETRYING = "UploadRetrying"
UPLOADED = "Uploaded"

_ERROR_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.]{0,63}")
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def retry_message(retry: UploadRetryReport) -> str:
    what = f"checkpoint step {retry.step}" if retry.step is not None else "a checkpoint"
    error = retry.last_error if retry.last_error and _ERROR_NAME.fullmatch(retry.last_error) else "an error"
    since = f" since {retry.since}" if retry.since and _TIMESTAMP.fullmatch(retry.since) else ""
    attempts = "1 failed attempt" if retry.failed_attempts == 1 else f"{retry.failed_attempts} failed attempts"
    return f"uploading {what} to S3: {attempts}{since} (last: {error}); retrying while training continues"


def uploaded_message(checkpoint: CheckpointStatus) -> str:
    step = f"step {checkpoint.step}" if checkpoint.step is not None else "the newest checkpoint"
    when = f" at {checkpoint.time}" if checkpoint.time else ""
    return f"checkpoint {step} uploaded{when}"


def storage_condition(
    previous: Condition | None,
    progress: ProgressReport | None,
    old: CheckpointStatus | None,
    new: CheckpointStatus | None,
) -> tuple[bool, str, str] | None:
    """(status, reason, message) of CheckpointStorage, or None to leave it as it is (or absent).

    `progress` is this pass's report from the trainer (None when it was not reached), `old` and `new` the
    status's checkpoint before and after this pass.
    """
    if progress is not None and progress.checkpoint_retry is not None:
        return False, RETRYING, retry_message(progress.checkpoint_retry)
    if new is None or new.latest is None:
        return None
    if progress is not None or (old is None or old.latest != new.latest) or (previous and previous.status == "True"):
        # The trainer answered and retries nothing, or a newer checkpoint landed: storage takes checkpoints.
        return True, UPLOADED, uploaded_message(new)
    return None
