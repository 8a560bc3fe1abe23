"""The trainer's signal that checkpoint uploads are being retried: failed S3 attempts seen as botocore retries
them, and the progress document's `checkpointRetry` (shown until the next commit)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from loom.workloads.common.s3 import make_client
from loom.workloads.trainer.checkpoint.retries import failure_of, watch_failures
from loom.workloads.trainer.config import ProgressSpec
from loom.workloads.trainer.tracking import Progress


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_failed_attempt_is_seen_while_botocore_retries_it_and_only_its_class_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    client = make_client(endpoint, max_attempts=2)
    seen: list[str] = []
    watch_failures(client, seen.append)
    try:
        client.put_object(Bucket="b", Key="k", Body=b"x")
    except Exception as error:
        raised = type(error).__name__
    else:
        raise AssertionError("put_object to a closed port succeeded")
    # botocore's max_attempts counts retries: the first attempt and both retries, each as it failed.
    assert seen == [raised] * 3 and raised == "EndpointConnectionError"
    assert all(endpoint not in error and "127.0.0.1" not in error for error in seen)


def test_a_failure_is_an_exception_or_a_retried_status_never_an_answer() -> None:
    assert failure_of(caught_exception=ConnectionResetError("reset by http://user:pw@host")) == "ConnectionResetError"
    assert failure_of((SimpleNamespace(status_code=503), {"Error": {"Code": "SlowDown"}})) == "SlowDown"
    assert failure_of((SimpleNamespace(status_code=500), {"Error": {"Code": "see http://x"}})) == "HTTP500"
    assert failure_of((SimpleNamespace(status_code=404), {"Error": {"Code": "NoSuchKey"}})) is None
    assert failure_of((SimpleNamespace(status_code=200), {})) is None
    assert failure_of() is None


def test_progress_shows_retries_until_the_next_commit(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    progress = Progress(ProgressSpec(file=str(path)), total_steps=100)
    assert progress.checkpoint_failed(20, "EndpointConnectionError") == 1
    assert progress.checkpoint_failed(None, "ConnectionClosedError") == 2
    retry = json.loads(path.read_text())["checkpointRetry"]
    assert retry["failedAttempts"] == 2 and retry["step"] == 20 and retry["lastError"] == "ConnectionClosedError"
    assert retry["since"].endswith("Z")
    progress.checkpoint_committed("s3://b/run/step-000000020", 20)
    doc = json.loads(path.read_text())
    assert "checkpointRetry" not in doc and doc["latestCheckpoint"]["step"] == 20
    assert progress.checkpoint_failed(30, "ReadTimeoutError") == 1  # a new outage counts from one
