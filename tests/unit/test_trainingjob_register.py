"""TrainingJob spec.register: when a job registers, what its version is tagged with, and that a succeeded job whose
registration has not happened yet (MLflow down) stays in the resync until it has."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.trainingjob.api import TrainingJobSpec, TrainingJobStatus
from loom.operator.kinds.trainingjob.controller import resync_due
from loom.operator.kinds.trainingjob.registration.version import needs_registration, version_tags

SPEC: dict[str, Any] = {
    "engine": "fsdp", "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
    "checkpoint": {"uri": "s3://ckpt/chargpt"}, "tracking": {"mlflow": {"trackingUri": "http://mlflow:5000"}},
    "register": {"model": "chargpt", "alias": "challenger", "tags": {"team": "ml"}},
}  # fmt: skip


def test_register_needs_a_checkpoint_and_mlflow() -> None:
    with pytest.raises(ValidationError, match="register needs checkpoint"):
        admitted(TrainingJobSpec, {k: v for k, v in SPEC.items() if k != "tracking"})
    assert TrainingJobSpec.model_validate(SPEC).registration is not None
    assert TrainingJobSpec.model_validate(SPEC).to_wire()["register"]["model"] == "chargpt"


def test_only_a_succeeded_job_with_a_run_registers_and_only_once() -> None:
    spec = TrainingJobSpec.model_validate(SPEC)
    running = TrainingJobStatus.model_validate({"phase": "Running", "mlflow": {"runId": "r"}})
    done = TrainingJobStatus.model_validate({"phase": "Succeeded", "mlflow": {"runId": "r"}})
    registered = TrainingJobStatus.model_validate({**done.to_wire(), "registeredModel": {"name": "chargpt",
                                                                                          "version": "4"}})
    assert not needs_registration(spec, running)
    assert needs_registration(spec, done)
    assert not needs_registration(spec, registered)


def test_version_tags() -> None:
    spec = TrainingJobSpec.model_validate(SPEC)
    status = TrainingJobStatus.model_validate({"phase": "Succeeded", "mlflow": {"runId": "r1"},
                                               "checkpoint": {"latest": "s3://ckpt/chargpt/step-200", "step": 200}})
    job = {"metadata": {"name": "chargpt", "namespace": "ml", "uid": "u1"}}
    assert version_tags(job, spec, status, {"loss": 1.234567891}) == {
        "loom.dev/trainingjob-uid": "u1", "loom.dev/trainingjob": "ml/chargpt", "loom.dev/run-id": "r1",
        "loom.dev/checkpoint": "s3://ckpt/chargpt/step-200", "loom.dev/step": "200", "metric.loss": "1.23457",
        "team": "ml",
    }  # fmt: skip


def test_a_succeeded_job_stays_due_until_registered() -> None:
    done: dict[str, Any] = {"spec": SPEC, "status": {"phase": "Succeeded"}}
    assert resync_due(done)
    done["status"]["registeredModel"] = {"name": "chargpt", "version": "1"}
    assert not resync_due(done)
    unregistered = {k: v for k, v in SPEC.items() if k != "register"}
    assert not resync_due({"spec": unregistered, "status": {"phase": "Succeeded"}})
