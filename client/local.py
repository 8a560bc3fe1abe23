"""Run a TrainingJob's task on this machine, without a cluster: `loom run -f job.yaml --local`, run_local(job).

The same code as in the cluster does the work: the operator's own rendering of the spec into the trainer's
config, the trainer under torchrun (one process per worker, or per GPU), its checkpoints (to the job's S3, or to a
local folder through the same calls), its resume from the newest complete checkpoint, and MLflow tracking into a
run created before the processes start, as the operator does. What cannot run here is refused with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from loom.operator.api import TrainingJob
from loom.operator.kinds.trainingjob.config import SpecError, trainer_config
from loom.workloads.trainer import config as trainer

from .mlflow_rest import ensure_run, set_run_status
from .models import name_of, namespace_of
from .validation import validate

LOCAL_RUN_TAG = "loom.dev/local-run"


class LocalRunRefused(ValueError):
    """The job cannot run on this machine as written; the message says why and what to change."""


@dataclass(frozen=True)
class LocalPlan:
    """What run_local will start: the trainer config, the command and its environment (pure, testable)."""

    config: trainer.TrainerConfig
    argv: list[str]
    env: dict[str, str]
    processes: int
    workdir: Path
    mlflow: tuple[str, str] | None  # (tracking URI, experiment)


@dataclass
class LocalRun:
    """The outcome of a local run: its exit code, the trainer's events and where things went."""

    returncode: int
    workdir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and bool(self.of("done"))

    @property
    def checkpoint_uri(self) -> str | None:
        """The newest checkpoint this run committed or resumed from."""
        found = [e["uri"] for e in self.events if e.get("event") in ("committed", "resume") and e.get("uri")]
        return found[-1] if found else None

    @property
    def model_uri(self) -> str | None:
        exported = self.of("exported")
        return str(exported[-1]["uri"]) if exported else None

    @property
    def resumed_from(self) -> str | None:
        resumed = self.of("resume")
        return str(resumed[0]["uri"]) if resumed else None


def visible_gpus() -> int:
    """CUDA devices torch sees here (0 without torch's CUDA build or a driver)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def plan(
    job: TrainingJob,
    *,
    workdir: Path,
    processes: int | None = None,
    checkpoint_dir: Path | None = None,
    tracking_uri: str | None = None,
    env: Mapping[str, str] | None = None,
    gpus_here: int | None = None,
) -> LocalPlan:
    """Check that the job can run here and render what to start (nothing is started)."""
    validate(job)
    spec = job.spec
    name = name_of(job)
    extra_env = dict(env or {})
    if spec.entrypoint.command:
        raise LocalRunRefused(
            "local mode runs module entrypoints (entrypoint.module) under the trainer; "
            f"entrypoint.command {spec.entrypoint.command!r} runs only in the job's image on the cluster"
        )
    per_worker = spec.workers.gpus_per_worker
    count = processes if processes is not None else spec.workers.replicas * max(1, per_worker)
    if count < 1:
        raise LocalRunRefused(f"processes must be at least 1, not {count}")
    if per_worker > 0:
        have = visible_gpus() if gpus_here is None else gpus_here
        if have < count:
            raise LocalRunRefused(
                f"TrainingJob {name} asks for GPUs (workers.gpusPerWorker: {per_worker}, {count} processes, one GPU "
                f"each) and this machine has {have} CUDA device(s). Run it with fewer processes (--processes "
                f"{have})" + (" or" if have else ",") + " set workers.gpusPerWorker: 0 to train on CPU here."
            )
    if spec.training_data is not None and "LOOM_TRAINING_DATA" not in extra_env:
        raise LocalRunRefused(
            "spec.trainingData builds its training set from a FeatureView in the cluster; to run locally, give the "
            "set's location as LOOM_TRAINING_DATA (an s3:// parquet or a local file) in the environment"
        )
    for var in spec.env or []:
        if var.value_from is not None and var.name not in extra_env and var.name not in os.environ:
            raise LocalRunRefused(
                f"env {var.name} comes from valueFrom ({', '.join(var.value_from)}), which needs the cluster: "
                f"set {var.name} in this environment (or pass it in env=)"
            )
    mlflow: tuple[str, str] | None = None
    if spec.tracking is not None and spec.tracking.mlflow is not None:
        uri = tracking_uri or spec.tracking.mlflow.tracking_uri
        if not uri:
            raise LocalRunRefused(
                "spec.tracking.mlflow names no trackingUri (in the cluster the operator's default applies): "
                "give one with --tracking-uri (tracking_uri=)"
            )
        mlflow = (uri, spec.tracking.mlflow.experiment)
        tracking = spec.tracking.model_copy(
            update={"mlflow": spec.tracking.mlflow.model_copy(update={"tracking_uri": uri})}
        )
        spec = spec.model_copy(update={"tracking": tracking})
    elif tracking_uri:
        raise LocalRunRefused("--tracking-uri needs spec.tracking.mlflow (the experiment to log to)")
    try:
        config = trainer_config(spec)
    except SpecError as error:
        raise LocalRunRefused(str(error)) from None

    workdir = workdir.resolve()
    updates: dict[str, Any] = {
        "progress": trainer.ProgressSpec(file=str(workdir / "progress.json"), metrics_port=None),
        "training": config.training.model_copy(update={"device": "cuda" if per_worker > 0 else "cpu"}),
    }
    if config.checkpoint is not None:
        checkpoint_updates: dict[str, Any] = {"staging_dir": str(workdir / "staging")}
        if checkpoint_dir is not None:
            # The folder stands in for the job's S3: <folder>/<bucket>/<prefix>/step-N, the same layout and calls.
            checkpoint_updates["endpoint"] = f"file://{checkpoint_dir.resolve()}"
        updates["checkpoint"] = config.checkpoint.model_copy(update=checkpoint_updates)
    elif checkpoint_dir is not None:
        raise LocalRunRefused("--checkpoint-dir needs spec.checkpoint (its uri names the bucket and prefix)")
    config = config.model_copy(update=updates)
    config = trainer.TrainerConfig.from_json(config.to_json())  # the trainer's own checks

    run_env = {**os.environ}
    for var in spec.env or []:
        if var.value is not None:
            run_env[var.name] = var.value
    run_env.update(extra_env)
    run_env.update({"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", "LOOM_TRAININGJOB": name})
    run_env.setdefault("OMP_NUM_THREADS", "1")
    if per_worker == 0:
        run_env.setdefault("DS_ACCELERATOR", "cpu")
        run_env["CUDA_VISIBLE_DEVICES"] = ""
    run_env.pop("MLFLOW_RUN_ID", None)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}",
        "--max-restarts=0", "--monitor-interval=0.5",
        "-m", "loom.workloads.trainer", "--config", str(workdir / "trainer.json"),
    ]
    return LocalPlan(config, argv, run_env, count, workdir, mlflow)


def default_workdir(job: TrainingJob) -> Path:
    """.loom/local/<namespace>-<name>: a second run of the same job finds its run id (and checkpoints) again."""
    return Path(".loom") / "local" / f"{namespace_of(job) or 'default'}-{name_of(job)}"


def run_local(
    job: TrainingJob,
    *,
    processes: int | None = None,
    workdir: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    tracking_uri: str | None = None,
    env: Mapping[str, str] | None = None,
    output: TextIO | None = None,
) -> LocalRun:
    """Run the job's task here under torchrun with `processes` processes (default: workers.replicas, times
    gpusPerWorker on GPUs) and return when it ends. Run it again after an interruption and it resumes from its
    newest complete checkpoint into the same MLflow run. Output lines go to `output` (default: stdout)."""
    folder = Path(workdir) if workdir is not None else default_workdir(job)
    folder.mkdir(parents=True, exist_ok=True)
    the_plan = plan(job, workdir=folder, processes=processes, env=env, tracking_uri=tracking_uri,
                    checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None)
    (the_plan.workdir / "trainer.json").write_text(the_plan.config.to_json())
    run = LocalRun(returncode=-1, workdir=the_plan.workdir)
    env_run = dict(the_plan.env)
    if the_plan.mlflow is not None:
        uri, experiment = the_plan.mlflow
        key = hashlib.sha256(str(the_plan.workdir).encode()).hexdigest()[:16]
        run.mlflow_run_id, run.mlflow_run_url = ensure_run(
            uri, experiment, run_name=f"local/{name_of(job)}", key_tag=(LOCAL_RUN_TAG, key)
        )
        env_run["MLFLOW_RUN_ID"] = run.mlflow_run_id
        # A rerun after a failure logs into the same run again.
        set_run_status(uri, run.mlflow_run_id, "RUNNING")
    sink = output if output is not None else sys.stdout
    process = subprocess.Popen(the_plan.argv, env=env_run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    (the_plan.workdir / "torchrun.pid").write_text(str(process.pid))
    assert process.stdout is not None
    try:
        for line in process.stdout:
            sink.write(line)
            start = line.find('{"event"')
            if start >= 0:
                with contextlib.suppress(json.JSONDecodeError):
                    run.events.append(json.loads(line[start:]))
        run.returncode = process.wait()
    except KeyboardInterrupt:
        # Ctrl-C: SIGTERM lets the trainer write a final checkpoint, as a pod being stopped does.
        os.killpg(process.pid, signal.SIGTERM)
        run.returncode = process.wait()
    if the_plan.mlflow is not None and run.mlflow_run_id:
        # As the operator does when a job ends: the run is FINISHED or FAILED (a rerun resumes it).
        set_run_status(the_plan.mlflow[0], run.mlflow_run_id, "FINISHED" if run.succeeded else "FAILED",
                       int(time.time() * 1000))
    return run
