"""The demo names the step at which the killed worker really died (#52 part 4): the trainer's last logged step,
not the TrainingJob status's step, which is a progress poll behind (the demo once printed "worker killed at step
81, resumed from the step-90 checkpoint"); and the loss picture's kill and resume marks never contradict."""

from __future__ import annotations

import json

from loom.e2e.demo import mlflow_run, training
from loom.e2e.demo.mlflow_run import Resume


def step_line(step: int) -> str:
    return json.dumps({"event": "step", "step": step, "loss": 1.5, "samplesPerSecond": 40.0})


def test_the_last_logged_step_is_read_from_the_trainers_structured_lines() -> None:
    log = "\n".join(
        [
            "W1128 torch.distributed: something about step 500",  # not a JSON step event
            step_line(80),
            json.dumps({"event": "checkpoint", "step": 90, "uri": "s3://b/j/step-000000090"}),
            step_line(90),
            "2026-11-28T22:00:00Z " + step_line(91),  # a prefixed line (a log timestamp) still counts
            '{"event": "step", "step": 9',  # a line cut by the kill
        ]
    )
    assert training.last_logged_step(log) == 91
    assert training.last_logged_step("") is None
    assert training.last_logged_step("starting\n" + json.dumps({"event": "restored", "step": 60})) is None


def test_the_death_step_is_the_trainers_not_the_lagging_status() -> None:
    # The #52 case: status said 81 while the trainer had logged 93 and written the step-90 checkpoint.
    assert training.death_step(logged_before=92, logged_after=93, checkpoint=90, status_step=81) == 93
    # Rank 0's pod already gone after the kill: the read just before it stands.
    assert training.death_step(logged_before=92, logged_after=None, checkpoint=90, status_step=81) == 92
    # The read after the kill found a new attempt's worker 0 (resumed from 60): the earlier read stands.
    assert training.death_step(logged_before=92, logged_after=61, checkpoint=90, status_step=81) == 92
    # No log at all: the status's step, never below the newest checkpoint the trainer had passed.
    assert training.death_step(logged_before=None, logged_after=None, checkpoint=90, status_step=81) == 90
    assert training.death_step(logged_before=None, logged_after=None, checkpoint=60, status_step=68) == 68


def test_the_kill_mark_is_never_before_the_checkpoint_the_restart_resumed_from() -> None:
    resumed = [Resume(attempt=(1, 0), step=90, uri="s3://b/j/step-000000090")]
    assert mlflow_run.kill_mark(81, resumed) == 90  # the #52 picture: kill drawn at 81, resume at 90
    assert mlflow_run.kill_mark(93, resumed) == 93
    assert mlflow_run.kill_mark(0, resumed) == 0  # no kill: no mark
    assert mlflow_run.kill_mark(75, []) == 75
    for kill in range(1, 200):
        for resume in range(0, 200, 10):
            assert mlflow_run.kill_mark(kill, [Resume((1, 0), resume, "s3://b/j")]) >= resume
