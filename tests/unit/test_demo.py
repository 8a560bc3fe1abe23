"""The demo's pure parts: its plain (non-terminal) output, the status it reads, the challenger it derives from an
example, and the loss picture it draws."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from loom.e2e.demo import graph, mlflow_run, pictures, training
from loom.e2e.demo.stage import example
from loom.e2e.demo.ui import TrainingView, Ui


def plain_ui() -> tuple[Ui, io.StringIO]:
    out = io.StringIO()
    return Ui(Console(file=out, force_terminal=False, width=200)), out


def test_plain_progress_prints_a_line_per_tenth_phase_or_restart_only() -> None:
    ui, out = plain_ui()
    with ui.training("TrainingJob chargpt") as bar:
        for step in range(0, 101):
            bar.update(TrainingView(phase="Running", step=step, total=100, loss=2.0 - step / 100, restarts=0))
        bar.update(TrainingView(phase="Restarting", step=100, total=100, loss=1.0, restarts=1))
    lines = out.getvalue().splitlines()
    assert len(lines) == 12  # tenths 0..10, then the restart
    assert lines[0].strip().startswith("step 0/100  Running")
    assert "loss 1.500" in lines[5] and "restarts 0" in lines[5]
    assert "Restarting" in lines[-1] and lines[-1].rstrip().endswith("restarts 1")
    assert "\x1b[" not in out.getvalue()  # no colours in CI logs


def test_view_reads_the_trainingjob_status_and_waits_on_missing_fields() -> None:
    assert training.view({}) == TrainingView(phase="Pending", step=0, total=0)
    status = {
        "phase": "Running",
        "restarts": 1,
        "progress": {"step": 70, "totalSteps": 200, "loss": 2.25, "samplesPerSecond": 512.0, "eta": "1m5s"},
    }
    seen = training.view(status)
    assert (seen.step, seen.total, seen.loss, seen.throughput, seen.eta, seen.restarts) == (
        70,
        200,
        2.25,
        512.0,
        "1m5s",
        1,
    )
    assert "loss 2.250" in seen.fields() and "ETA  1m5s" in seen.fields()


def test_the_challenger_is_the_serving_example_renamed_for_the_graph() -> None:
    (graph_doc,) = example(graph.FILE)
    names = {step["serviceName"] for step in graph_doc["spec"]["nodes"]["root"]["steps"]}
    (served,) = example("inferenceservice-chargpt-from-trainingjob.yaml")
    doc = graph.challenger()
    assert names == {served["metadata"]["name"], doc["metadata"]["name"]}
    assert doc["spec"]["model"] == served["spec"]["model"] and doc["spec"]["replicas"] == 1
    assert served["metadata"]["name"] == "chargpt-current"  # the example file itself is unchanged


def test_loss_picture_is_a_png_with_both_attempts(tmp_path: Path) -> None:
    first = [{"step": s, "value": 3.0 - s / 100, "timestamp": s} for s in range(1, 71)]
    again = [{"step": s, "value": 2.5 - s / 200, "timestamp": 1000 + s} for s in range(61, 201)]
    out = tmp_path / "loss.png"
    resumed = [mlflow_run.Resume(attempt=(1, 0), step=60, uri="s3://b/job/step-000000060")]
    pictures.plot_loss(first + again, kill_step=70, resumed=resumed, title="loss", out=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_resumes_are_read_from_the_trainers_tags_in_restart_order() -> None:
    tags = {
        "loom.resume.2.0": "s3://b/job/step-000000120@120",  # gang attempt 2, torchrun's first start in it
        "loom.resume.1.0": "s3://b/job/step-000000060@60",
        "loom.resume.1.1": "s3://b/job/step-000000070@70",  # torchrun restarted inside attempt 1
        "mlflow.runName": "chargpt",
        "loom.resume.note": "a person's tag@3",  # not numbers: not a resume
        "loom.resume.3.0": "no step here",
    }
    assert [(r.attempt, r.step) for r in mlflow_run.resumes(tags)] == [((1, 0), 60), ((1, 1), 70), ((2, 0), 120)]
    assert mlflow_run.resumes({"loom.resume.0": "s3://b/j/step-000000060@60"}) == [  # an older trainer's tag
        mlflow_run.Resume(attempt=(0,), step=60, uri="s3://b/j/step-000000060")
    ]
    assert mlflow_run.resumes({}) == []


def test_the_demo_writes_its_pictures_to_its_own_ignored_folder_never_over_tracked_files() -> None:
    """`git status` stays clean after `make demo`: what it writes is git-ignored and none of it is a tracked file."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    written = [pictures.LOSS_PNG, pictures.RUN_PNG]
    assert all(path.parent == pictures.OUTPUT for path in written)
    assert pictures.README_IMAGES not in pictures.OUTPUT.parents and pictures.OUTPUT != pictures.README_IMAGES
    for path in written:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=repo, capture_output=True)
        assert tracked.returncode != 0, f"the demo would overwrite the tracked {path}"
        if repo in path.parents:
            ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=repo)
            assert ignored.returncode == 0, f"{path} would show in git status"


def test_refreshing_the_readme_pictures_is_a_separate_step_that_copies_the_last_run(tmp_path: Path) -> None:
    source, target = tmp_path / "out", tmp_path / "docs" / "img"
    with pytest.raises(FileNotFoundError, match="make demo"):
        pictures.refresh_readme(source, target)
    source.mkdir()
    (source / pictures.LOSS_NAME).write_bytes(b"png")
    copied = pictures.refresh_readme(source, target)
    assert copied == [target / pictures.LOSS_NAME] and (target / pictures.LOSS_NAME).read_bytes() == b"png"
