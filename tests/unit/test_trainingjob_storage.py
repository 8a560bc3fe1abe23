"""CheckpointStorage: the condition that says checkpoint uploads are being retried (pure), through the state
machine and from the trainer's progress document."""

from __future__ import annotations

from typing import Any

from loom.operator.core.model import Condition
from loom.operator.kinds.trainingjob.api import CheckpointStatus
from loom.operator.kinds.trainingjob.decision import Decision
from loom.operator.kinds.trainingjob.observe import CheckpointReport, ProgressReport, UploadRetryReport, parse_progress
from loom.operator.kinds.trainingjob.storage import storage_condition

from .test_trainingjob_state import running, spec, step, worker

RETRY = UploadRetryReport(
    failed_attempts=7, last_error="EndpointConnectionError", step=20, since="2026-03-01T11:59:30Z"
)
CKPT_10 = CheckpointStatus(latest="s3://b/run/step-000000010", step=10, time="2026-03-01T11:58:00Z")
CKPT_30 = CheckpointStatus(latest="s3://b/run/step-000000030", step=30, time="2026-03-01T12:00:00Z")


def _cond(status: str, reason: str) -> Condition:
    return Condition(type="CheckpointStorage", status=status, reason=reason, message="")  # type: ignore[arg-type]


def test_retrying_uploads_make_the_condition_false_with_a_readable_message() -> None:
    result = storage_condition(None, ProgressReport(step=25, checkpoint_retry=RETRY), CKPT_10, CKPT_10)
    assert result == (
        False,
        "UploadRetrying",
        "uploading checkpoint step 20 to S3: 7 failed attempts since 2026-03-01T11:59:30Z "
        "(last: EndpointConnectionError); retrying while training continues",
    )


def test_the_next_checkpoint_landing_makes_it_true_again() -> None:
    retrying = _cond("False", "UploadRetrying")
    landed = ProgressReport(step=31, latest_checkpoint=CheckpointReport(uri=str(CKPT_30.latest), step=30))
    assert storage_condition(retrying, landed, CKPT_10, CKPT_30) == (
        True, "Uploaded", "checkpoint step 30 uploaded at 2026-03-01T12:00:00Z"
    )


def test_without_a_report_a_retrying_condition_stays_until_a_newer_checkpoint_is_known() -> None:
    retrying = _cond("False", "UploadRetrying")
    assert storage_condition(retrying, None, CKPT_10, CKPT_10) is None  # trainer not reached: nothing new
    # The final checkpoint, named by the trainer's exit message after its last poll.
    assert storage_condition(retrying, None, CKPT_10, CKPT_30) == (
        True, "Uploaded", "checkpoint step 30 uploaded at 2026-03-01T12:00:00Z"
    )


def test_no_condition_before_the_first_checkpoint_or_failure() -> None:
    assert storage_condition(None, ProgressReport(step=3), None, None) is None
    assert storage_condition(None, None, None, None) is None


def test_the_trainers_words_reach_status_only_as_identifiers_and_timestamps() -> None:
    hostile = UploadRetryReport(failed_attempts=1, last_error="http://key:secret@s3.local/", since="soon; rm -rf")
    result = storage_condition(None, ProgressReport(checkpoint_retry=hostile), None, None)
    assert result is not None
    assert result[2] == (
        "uploading a checkpoint to S3: 1 failed attempt (last: an error); retrying while training continues"
    )


def test_parse_progress_reads_the_retry_and_ignores_a_malformed_one() -> None:
    doc: dict[str, Any] = {"step": 25, "checkpointRetry": {"failedAttempts": 7, "lastError": "EndpointConnectionError",
                                                           "step": 20, "since": "2026-03-01T11:59:30Z"}}
    report = parse_progress(doc)
    assert report is not None and report.checkpoint_retry == RETRY
    for bad in ({"failedAttempts": "7"}, {"failedAttempts": 0}, "retrying", {"failedAttempts": True}):
        parsed = parse_progress({"step": 25, "checkpointRetry": bad})
        assert parsed is not None and parsed.checkpoint_retry is None


def _storage(decision: Decision) -> tuple[str, str, str] | None:
    for c in decision.status.conditions:
        if c.type == "CheckpointStorage":
            return c.status, c.reason, c.message
    return None


def test_the_state_machine_reports_an_outage_and_its_end_with_events_and_training_goes_on() -> None:
    pods = (worker(0), worker(1))
    job = running().status
    assert _storage(step(job, pods, progress=ProgressReport(step=5))) is None
    first = CheckpointReport(uri=str(CKPT_10.latest), step=10, time=CKPT_10.time)
    saved = step(job, pods, progress=ProgressReport(step=12, latest_checkpoint=first))
    assert _storage(saved) == ("True", "Uploaded", "checkpoint step 10 uploaded at 2026-03-01T11:58:00Z")
    assert not [e for e in saved.events if e.reason.startswith("Checkpoint")]

    down = step(saved.status, pods, progress=ProgressReport(step=25, latest_checkpoint=first, checkpoint_retry=RETRY))
    assert down.status.phase == "Running" and down.create == [] and down.delete == []  # training continues
    storage = _storage(down)
    assert storage is not None and storage[:2] == ("False", "UploadRetrying") and "7 failed attempts" in storage[2]
    assert [(e.type, e.reason) for e in down.events] == [("Warning", "CheckpointUploadRetrying")]
    again = step(down.status, pods, progress=ProgressReport(step=26, latest_checkpoint=first, checkpoint_retry=RETRY))
    assert not again.events  # one event per outage, not one per poll

    second = CheckpointReport(uri=str(CKPT_30.latest), step=30, time=CKPT_30.time)
    back = step(again.status, pods, progress=ProgressReport(step=31, latest_checkpoint=second))
    assert _storage(back) == ("True", "Uploaded", "checkpoint step 30 uploaded at 2026-03-01T12:00:00Z")
    assert [(e.type, e.reason) for e in back.events] == [("Normal", "CheckpointUploaded")]


def test_a_job_that_has_not_checkpointed_yet_gets_no_condition() -> None:
    decision = step(running().status, (worker(0), worker(1)), the_spec=spec(), progress=ProgressReport(step=3))
    assert decision.status.phase == "Running" and _storage(decision) is None
