"""Local mode for real: a TrainingJob's task under torchrun with 2 processes on this machine, checkpointing to a
local folder through the trainer's own checkpoint code, tracked in a real MLflow server, killed (SIGKILL, the whole
process group) once a checkpoint is committed, and run again: it resumes from the newest complete checkpoint into
the same MLflow run and finishes, exporting the model."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.client import (
    CheckpointSpec,
    Entrypoint,
    MlflowTracking,
    Tracking,
    TrainingJobSpec,
    Workers,
    run_local,
    training_job,
)
from loom.devstack.servers import MLflowEndpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = ["nLayer=2", "nEmbd=32", "nHead=2", "blockSize=16"]


class KillAfterCommit(io.StringIO):
    """The run's output sink: on the first committed checkpoint at or after `step`, SIGKILL the torchrun group."""

    def __init__(self, workdir: Path, step: int) -> None:
        super().__init__()
        self.workdir, self.step, self.killed_at = workdir, step, None

    def write(self, text: str) -> int:
        start = text.find('{"event"')
        if start >= 0 and self.killed_at is None:
            event = json.loads(text[start:])
            if event["event"] == "committed" and event["step"] >= self.step:
                self.killed_at = event["step"]
                os.killpg(int((self.workdir / "torchrun.pid").read_text()), signal.SIGKILL)
        return super().write(text)


def mlflow_get(mlflow: MLflowEndpoint, path: str, **params: Any) -> dict[str, Any]:
    response = httpx.get(f"{mlflow.url}/api/2.0/mlflow/{path}", params=params, timeout=30, trust_env=False)
    response.raise_for_status()
    return dict(response.json())


def test_a_two_process_local_run_resumes_after_a_kill_into_the_same_mlflow_run(
    tmp_path: Path, mlflow: MLflowEndpoint
) -> None:
    job = training_job(
        "local-gpt",
        TrainingJobSpec(
            engine="fsdp",
            entrypoint=Entrypoint(module="loom.workloads.trainer.examples.chargpt:task", args=TINY),
            max_steps=24,
            workers=Workers(replicas=2),
            checkpoint=CheckpointSpec(uri="s3://checkpoints/local-gpt", every_steps=4, keep_last=2),
            tracking=Tracking(mlflow=MlflowTracking(tracking_uri=mlflow.url, experiment="sdk-local")),
        ),
    )
    workdir, folder = tmp_path / "run", tmp_path / "store"
    sink = KillAfterCommit(workdir, step=8)
    first = run_local(job, workdir=workdir, checkpoint_dir=folder, output=sink)
    assert sink.killed_at is not None, sink.getvalue()[-3000:]
    assert first.returncode != 0 and not first.succeeded
    assert first.of("start")[0]["worldSize"] == 2
    committed = [e["step"] for e in first.of("committed")]

    second = run_local(job, workdir=workdir, checkpoint_dir=folder, output=io.StringIO())
    assert second.succeeded, second.returncode
    # The newest complete checkpoint in the folder, whatever the kill cut short after it.
    [resume] = second.of("resume")
    assert resume["step"] == max(committed) >= 8
    assert second.resumed_from == f"s3://checkpoints/local-gpt/step-{resume['step']:09d}"
    assert second.of("start")[0]["startStep"] == resume["step"]
    assert second.of("done")[0]["step"] == 24

    # The same checkpoint layout as in S3, under the folder, and the exported model beside it.
    prefix = folder / "checkpoints" / "local-gpt"
    complete = sorted(p.parent.name for p in prefix.glob("step-*/manifest.json"))
    assert complete[-1] == "step-000000024" and len(complete) == 2  # keepLast: 2
    assert second.model_uri == "s3://checkpoints/local-gpt/final"
    assert (prefix / "final" / "model.pt").is_file() and (prefix / "final" / "config.json").is_file()

    # One MLflow run for both attempts, created before the processes, with the whole loss curve.
    assert first.mlflow_run_id == second.mlflow_run_id is not None
    run = mlflow_get(mlflow, "runs/get", run_id=second.mlflow_run_id)["run"]
    assert run["info"]["status"] == "FINISHED"
    history = mlflow_get(mlflow, "metrics/get-history", run_id=second.mlflow_run_id, metric_key="loss")["metrics"]
    assert {m["step"] for m in history} >= set(range(1, 25))
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    assert tags.get("loom.dev/local-run")
    resumes = {k: v for k, v in tags.items() if k.startswith("loom.resume.")}
    assert list(resumes.values()) == [f"{second.resumed_from}@{resume['step']}"]
