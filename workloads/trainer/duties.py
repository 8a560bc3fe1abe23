"""Rank 0's duties toward the outside world, as one object: structured events on stdout, the progress file
and endpoint the operator reads, MLflow tracking, the published final model and the exit-0 termination
message. Every other rank gets `Duties`, whose methods do nothing, so the training loop never asks which
rank it runs on.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.s3 import S3Location, make_client, upload_file
from .config import EXIT_OK, MLflowSpec, TrainerConfig
from .tracking import MLflowTracker, Progress, flatten, write_termination_message

if TYPE_CHECKING:
    import torch

    from .checkpoint.manager import Restored

# A task's own export (TrainTask.export_files): (weights, its description, the folder) -> whether it wrote one.
ExportWriter = Callable[["dict[str, torch.Tensor]", "dict[str, Any]", Path], bool]


def emit(event: str, **fields: Any) -> None:
    """One JSON line per event on stdout: structured logs that tests and humans can read."""
    print(json.dumps({"event": event, **fields}), flush=True)


class Duties:
    """A rank other than 0: nothing to report, track or publish."""

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run this job logs to; saved in checkpoints so a resumed run continues it."""
        return None

    def begin(self, start_step: int, restored: Restored | None) -> None:
        """Training is about to start at `start_step + 1`, from `restored` when it resumed."""

    def stepped(self, step: int, loss: float, lr: float, metrics: Mapping[str, float], stopping: bool) -> None:
        """`step` finished with the mean `loss` over all ranks."""

    def checkpoint_saved(self, step: int, stall_s: float, final: bool) -> None:
        """A checkpoint of `step` was handed over; the loop was blocked for `stall_s`."""

    def checkpoint_committed(self, step: int, uri: str) -> None:
        """The checkpoint of `step` is complete at `uri` (called from the checkpoint thread)."""

    def checkpoint_retrying(self, step: int | None, error: str) -> None:
        """An S3 attempt of the checkpoint of `step` failed with `error` (a class name) and is retried (called from
        the checkpoint thread and S3 transfer threads)."""

    def export_model(self, state: dict[str, torch.Tensor], describe: Callable[[], dict[str, Any]],
                     write: ExportWriter | None = None) -> None:
        """Publish the final weights (gathered by every rank) and the task's description of the model; ``write``
        is the task's own export format (TrainTask.export_files), if it has one."""

    def interrupted(self, step: int) -> None:
        """Training stopped at `step` on SIGTERM, after its final checkpoint."""

    def finished(self, step: int, loss: float) -> None:
        """Every step ran; the run succeeded."""


class Rank0Duties(Duties):
    def __init__(
        self,
        config: TrainerConfig,
        world_size: int,
        restart: int,
        tokens_per_sample: int | None = None,
        tracker_factory: Callable[[MLflowSpec, str | None], MLflowTracker] = MLflowTracker,
        clock: Callable[[], float] = time.perf_counter,
        attempt: int = 0,
    ) -> None:
        self.config = config
        self.world_size = world_size
        self.restart = restart
        self.attempt = attempt  # the operator's gang attempt; `restart` counts torchrun's restarts inside it
        # Throughput in tokens needs both: the data's tokens per sample and a model that counts its FLOPs.
        self.tokens_per_sample = tokens_per_sample
        self.tracker_factory = tracker_factory
        self.clock = clock
        self.progress = Progress(config.progress, config.training.max_steps)
        self.tracker: MLflowTracker | None = None
        self.window_start = clock()
        self.window_steps = 0

    @property
    def mlflow_run_id(self) -> str | None:
        return self.tracker.run_id if self.tracker else None

    @property
    def samples_per_step(self) -> int:
        return self.config.training.batch_size * self.world_size

    def begin(self, start_step: int, restored: Restored | None) -> None:
        config = self.config
        mlflow = config.tracking.mlflow
        if mlflow:
            # A resumed run continues the MLflow run its checkpoint names.
            previous_run = restored.trainer_state.get("mlflowRunId") if restored else None
            self.tracker = self.tracker_factory(mlflow, previous_run)
            params = flatten("", config.model_dump(mode="json", by_alias=True))
            self.tracker.log_params({**params, "worldSize": self.world_size})
            if restored:
                # One tag per resume: a new gang's torchrun counts from 0 again, so the gang attempt leads.
                self.tracker.set_tag(f"loom.resume.{self.attempt}.{self.restart}", f"{restored.uri}@{restored.step}")
        emit("start", rank=0, worldSize=self.world_size, restart=self.restart, engine=config.engine.value,
             startStep=start_step, resumedFrom=restored.uri if restored else None)
        if restored:
            emit("resume", step=restored.step, uri=restored.uri, worldSize=self.world_size)
            # The checkpoint resumed from stays the newest one until the next commit. A run that resumes at
            # its final step commits nothing new, and still has to name it when it finishes.
            self.progress.checkpoint_restored(restored.uri, restored.step, restored.committed_at)
        self.window_start, self.window_steps = self.clock(), 0

    def stepped(self, step: int, loss: float, lr: float, metrics: Mapping[str, float], stopping: bool) -> None:
        self.window_steps += 1
        max_steps = self.config.training.max_steps
        if not (step % self.config.training.log_every_steps == 0 or stopping or step == max_steps):
            return
        elapsed = self.clock() - self.window_start
        samples_per_second = self.window_steps * self.samples_per_step / max(elapsed, 1e-9)
        eta = (max_steps - step) * self.samples_per_step / max(samples_per_second, 1e-9)
        emit("step", step=step, loss=round(loss, 6), samplesPerSecond=round(samples_per_second, 2))
        self.progress.update(step, loss, samples_per_second, eta, "Running")
        if self.tracker:
            logged = {"loss": loss, "samples_per_second": samples_per_second, "lr": lr, **metrics}
            if self.tokens_per_sample:
                logged["tokens_per_second"] = samples_per_second * self.tokens_per_sample
            self.tracker.log_metrics(logged, step)
        self.window_start, self.window_steps = self.clock(), 0

    def checkpoint_saved(self, step: int, stall_s: float, final: bool) -> None:
        self.progress.stalled(stall_s)
        emit("checkpoint", step=step, stallSeconds=round(stall_s, 4), final=final)

    def checkpoint_committed(self, step: int, uri: str) -> None:
        self.progress.checkpoint_committed(uri, step)
        if self.tracker:
            self.tracker.set_tag("loom.checkpoint.latest", uri)
            self.tracker.log_metrics({"checkpoint_step": float(step)}, step)
        emit("committed", step=step, uri=uri)

    def checkpoint_retrying(self, step: int | None, error: str) -> None:
        failed = self.progress.checkpoint_failed(step, error)
        # The first failure and then every doubling: an outage of minutes stays a handful of lines.
        if failed & (failed - 1) == 0:
            emit("checkpointRetry", step=step, failedAttempts=failed, lastError=error)

    def export_model(self, state: dict[str, torch.Tensor], describe: Callable[[], dict[str, Any]],
                     write: ExportWriter | None = None) -> None:
        """Full weights + config.json (or the task's own format, e.g. a Hugging Face folder): to the output URI in
        S3 and as the MLflow run's `model` artifact."""
        import torch

        config = self.config
        destination = config.output_uri()
        log_model = self.tracker is not None and config.tracking.mlflow is not None and config.tracking.mlflow.log_model
        with tempfile.TemporaryDirectory(prefix="loom-export-") as folder_name:
            folder = Path(folder_name)
            description = describe()
            if write is None or not write(state, description, folder):
                torch.save(state, folder / "model.pt")
                (folder / "config.json").write_text(json.dumps(description, indent=1))
            if destination:
                client = make_client(config.checkpoint.endpoint if config.checkpoint else None)
                root = S3Location.parse(destination)
                for path in folder.iterdir():
                    upload_file(client, path, root.child(path.name))
                emit("exported", uri=destination)
            if log_model and self.tracker is not None:
                self.tracker.log_artifacts(folder, "model")
                if destination:
                    self.tracker.set_tag("loom.model.uri", destination)

    def interrupted(self, step: int) -> None:
        emit("interrupted", step=step)
        self.progress.finish("Interrupted")
        if self.tracker:
            self.tracker.flush()

    def finished(self, step: int, loss: float) -> None:
        emit("done", step=step, loss=round(loss, 6))
        self.progress.finish("Succeeded")
        if self.tracker:
            self.tracker.end("FINISHED")
        # The newest checkpoint is committed after the operator's last progress poll: name it on exit.
        # A NaN loss (nothing left to train after a resume) is left out: JSON has no NaN.
        final = {"step": step, **({"loss": round(loss, 6)} if math.isfinite(loss) else {})}
        write_termination_message(EXIT_OK, "training finished", self.progress.latest_checkpoint(), final=final)


def duties_for(
    rank: int,
    config: TrainerConfig,
    world_size: int,
    restart: int,
    tokens_per_sample: int | None = None,
    attempt: int = 0,
) -> Duties:
    if rank != 0:
        return Duties()
    return Rank0Duties(config, world_size, restart, tokens_per_sample, attempt=attempt)
