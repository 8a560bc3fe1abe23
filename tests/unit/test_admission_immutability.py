"""TrainingJob fields frozen once the job has started."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from loom.operator.admission.immutability import FROZEN_ONCE_STARTED, trainingjob_update_violations


def job(phase: str | None = "Running") -> dict[str, Any]:
    return {
        "spec": {
            "engine": "fsdp",
            "image": "loom/trainer:1",
            "entrypoint": {"module": "pkg.mod:task"},
            "maxSteps": 100,
            "workers": {"replicas": 2, "gpusPerWorker": 1},
            "checkpoint": {"uri": "s3://b/ckpt", "everySteps": 10},
            "runPolicy": {"suspend": False, "backoffLimit": 3},
        },
        "status": {"phase": phase} if phase else {},
    }


def changed(old: dict[str, Any], *path: str, value: Any) -> dict[str, Any]:
    new = copy.deepcopy(old)
    target = new["spec"]
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return new


@pytest.mark.parametrize("path", FROZEN_ONCE_STARTED, ids=".".join)
def test_each_frozen_field_is_refused_once_started(path: tuple[str, ...]) -> None:
    old = job("Running")
    [violation] = trainingjob_update_violations(old, changed(old, *path, value={"changed": True}))
    assert violation.field == "spec." + ".".join(path)
    assert "cannot change once the job has started (phase Running)" in violation.message
    assert "create a new TrainingJob" in violation.message


@pytest.mark.parametrize("phase", [None, "Pending"])
def test_before_the_first_worker_everything_may_change(phase: str | None) -> None:
    old = job(phase)
    assert trainingjob_update_violations(old, changed(old, "workers", "replicas", value=8)) == []


@pytest.mark.parametrize("phase", ["Created", "Restarting", "Suspended", "Succeeded", "Failed"])
def test_every_started_phase_freezes(phase: str) -> None:
    old = job(phase)
    assert [v.field for v in trainingjob_update_violations(old, changed(old, "image", value="x"))] == ["spec.image"]


def test_what_the_controller_handles_safely_stays_mutable_while_running() -> None:
    old = job("Running")
    new = changed(old, "runPolicy", "suspend", value=True)
    new = changed(new, "maxSteps", value=500)
    new = changed(new, "workers", "nodeSelector", value={"pool": "a100"})
    new = changed(new, "checkpoint", "everySteps", value=50)
    assert trainingjob_update_violations(old, new) == []


def test_adding_or_removing_a_frozen_field_counts_as_a_change() -> None:
    old = job("Running")
    new = copy.deepcopy(old)
    del new["spec"]["image"]
    assert [v.field for v in trainingjob_update_violations(old, new)] == ["spec.image"]
