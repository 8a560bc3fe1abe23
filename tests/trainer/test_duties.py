"""Rank 0's duties (events, progress, MLflow, exit message) and the silent twin other ranks hold, driven
directly: no process group, no model, no MLflow server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loom.workloads.trainer.checkpoint.manager import Restored
from loom.workloads.trainer.config import MLflowSpec, TrainerConfig
from loom.workloads.trainer.duties import Duties, Rank0Duties, duties_for

COMMITTED_AT = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class FakeTracker:
    """Records what the duties send to MLflow."""

    def __init__(self, spec: MLflowSpec, run_id: str | None) -> None:
        self.spec, self.run_id = spec, run_id or "new-run"
        self.params: dict[str, Any] = {}
        self.tags: dict[str, str] = {}
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.ended: str | None = None
        self.flushed = 0

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def set_tag(self, key: str, value: str) -> None:
        self.tags[key] = value

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def flush(self) -> None:
        self.flushed += 1

    def end(self, status: str) -> None:
        self.ended = status


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_config(tmp_path: Path, mlflow: bool = True) -> TrainerConfig:
    doc: dict[str, Any] = {
        "training": {"maxSteps": 6, "batchSize": 4, "logEverySteps": 2},
        "checkpoint": {"uri": "s3://bucket/job", "everySteps": 2},
        "progress": {"file": str(tmp_path / "progress.json")},
    }
    if mlflow:
        doc["tracking"] = {"mlflow": {"trackingUri": "http://mlflow.invalid", "experiment": "e"}}
    return TrainerConfig.model_validate(doc)


def events(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"event"')]


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination"
    monkeypatch.setenv("LOOM_TERMINATION_LOG", str(path))
    return path


def test_rank0_reports_every_log_step_with_throughput_over_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = Clock()
    trackers: list[FakeTracker] = []

    def tracker(spec: MLflowSpec, run_id: str | None) -> Any:
        trackers.append(FakeTracker(spec, run_id))
        return trackers[-1]

    duties = Rank0Duties(make_config(tmp_path), world_size=2, restart=0, tokens_per_sample=32,
                         tracker_factory=tracker, clock=clock)
    duties.begin(0, None)
    (run,) = trackers
    assert run.run_id == "new-run" and duties.mlflow_run_id == "new-run"
    assert run.params["engine"] == "fsdp" and run.params["worldSize"] == 2
    assert run.params["training.maxSteps"] == 6

    clock.now = 101.0
    duties.stepped(1, 2.5, lr=0.01, metrics={"acc": 0.5}, stopping=False)  # not a log step
    clock.now = 102.0
    duties.stepped(2, 2.0, lr=0.02, metrics={"acc": 0.6}, stopping=False)
    # Two steps x 4 samples x 2 ranks in 2 s; 4 steps left at that rate take 4 s.
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert (progress["step"], progress["loss"], progress["samplesPerSecond"], progress["eta"]) == (2, 2.0, 8.0, 4.0)
    assert progress["phase"] == "Running" and progress["totalSteps"] == 6
    assert run.metrics == [(2, {"loss": 2.0, "samples_per_second": 8.0, "lr": 0.02, "acc": 0.6,
                                "tokens_per_second": 256.0})]
    clock.now = 102.5
    duties.stepped(3, 1.5, lr=0.03, metrics={}, stopping=True)  # a stop is always reported
    assert run.metrics[-1] == (3, {"loss": 1.5, "samples_per_second": 16.0, "lr": 0.03, "tokens_per_second": 512.0})

    out = events(capsys.readouterr().out)
    assert [e["event"] for e in out] == ["start", "step", "step"]
    assert out[0] == {"event": "start", "rank": 0, "worldSize": 2, "restart": 0, "engine": "fsdp", "startStep": 0,
                      "resumedFrom": None}
    assert [(e["step"], e["samplesPerSecond"]) for e in out[1:]] == [(2, 8.0), (3, 16.0)]


def test_a_resumed_run_continues_its_mlflow_run_and_names_the_checkpoint_it_resumed_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], termination_log: Path
) -> None:
    trackers: list[FakeTracker] = []

    def tracker(spec: MLflowSpec, run_id: str | None) -> Any:
        trackers.append(FakeTracker(spec, run_id))
        return trackers[-1]

    duties = Rank0Duties(make_config(tmp_path), world_size=2, restart=1, tracker_factory=tracker, attempt=2)
    restored = Restored(step=6, uri="s3://bucket/job/step-000000006", trainer_state={"mlflowRunId": "run-7"},
                        committed_at=COMMITTED_AT)
    duties.begin(6, restored)
    (run,) = trackers
    assert run.run_id == "run-7"
    # Gang attempt 2, torchrun's restart 1 inside it: a later gang (torchrun counting from 0 again) cannot
    # overwrite this resume's tag.
    assert run.tags == {"loom.resume.2.1": "s3://bucket/job/step-000000006@6"}
    latest = {"uri": "s3://bucket/job/step-000000006", "step": 6, "time": "2023-11-14T22:13:20Z"}
    assert json.loads((tmp_path / "progress.json").read_text())["latestCheckpoint"] == latest

    # Nothing left to train: the exit message still names the final checkpoint.
    duties.finished(6, float("nan"))
    assert json.loads(termination_log.read_text()) == {"exitCode": 0, "message": "training finished",
                                                       "checkpoint": latest, "final": {"step": 6}}
    assert run.ended == "FINISHED"
    out = events(capsys.readouterr().out)
    assert [e["event"] for e in out] == ["start", "resume", "done"]
    assert out[1] == {"event": "resume", "step": 6, "uri": "s3://bucket/job/step-000000006", "worldSize": 2}


def test_success_message_names_the_newest_committed_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], termination_log: Path
) -> None:
    duties = Rank0Duties(make_config(tmp_path, mlflow=False), world_size=1, restart=0)
    duties.begin(0, None)
    duties.checkpoint_saved(4, 0.25, final=False)
    duties.checkpoint_committed(4, "s3://bucket/job/step-000000004")
    duties.checkpoint_saved(6, 1.5, final=True)
    duties.checkpoint_committed(6, "s3://bucket/job/step-000000006")
    duties.finished(6, 1.25)

    doc = json.loads(termination_log.read_text())
    assert doc["exitCode"] == 0 and doc["message"] == "training finished"
    assert {k: doc["checkpoint"][k] for k in ("uri", "step")} == {"uri": "s3://bucket/job/step-000000006", "step": 6}
    assert doc["final"] == {"step": 6, "loss": 1.25}
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["phase"] == "Succeeded" and progress["latestCheckpoint"] == doc["checkpoint"]
    out = events(capsys.readouterr().out)
    assert [(e["event"], e.get("step")) for e in out] == [
        ("start", None), ("checkpoint", 4), ("committed", 4), ("checkpoint", 6), ("committed", 6), ("done", 6)]
    assert out[3] == {"event": "checkpoint", "step": 6, "stallSeconds": 1.5, "final": True}


def test_an_interrupted_run_says_so_and_writes_no_success_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], termination_log: Path
) -> None:
    trackers: list[FakeTracker] = []

    def tracker(spec: MLflowSpec, run_id: str | None) -> Any:
        trackers.append(FakeTracker(spec, run_id))
        return trackers[-1]

    duties = Rank0Duties(make_config(tmp_path), world_size=1, restart=0, tracker_factory=tracker)
    duties.begin(0, None)
    duties.interrupted(3)
    assert json.loads((tmp_path / "progress.json").read_text())["phase"] == "Interrupted"
    assert trackers[0].flushed == 1 and trackers[0].ended is None  # the run goes on after the restart
    assert not termination_log.exists()  # the launcher reports the stop from every process
    assert events(capsys.readouterr().out)[-1] == {"event": "interrupted", "step": 3}


def test_other_ranks_hold_duties_that_do_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], termination_log: Path
) -> None:
    config = make_config(tmp_path)
    duties = duties_for(1, config, world_size=2, restart=0)
    assert type(duties) is Duties and duties.mlflow_run_id is None
    duties.begin(0, None)
    duties.stepped(2, 1.0, lr=0.1, metrics={}, stopping=True)
    duties.checkpoint_saved(2, 0.1, final=True)
    duties.checkpoint_committed(2, "s3://bucket/job/step-000000002")
    duties.export_model({}, lambda: pytest.fail("only rank 0 describes the model"))
    duties.interrupted(2)
    duties.finished(2, 1.0)
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "progress.json").exists() and not termination_log.exists()
    assert isinstance(duties_for(0, config, world_size=2, restart=0), Rank0Duties)
