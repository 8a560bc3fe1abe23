"""The training run inside one torchrun worker: set up, resume, train, checkpoint, export, stop cleanly."""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from loom.workloads.common.s3 import S3Location, make_client, upload_file
from loom.workloads.trainer.checkpoint.manager import CheckpointManager, Restored, new_session_id
from loom.workloads.trainer.config import EXIT_INTERRUPTED, EXIT_OK, ConfigError, TrainerConfig
from loom.workloads.trainer.engines import build_engine
from loom.workloads.trainer.task import TaskContext, TrainTask
from loom.workloads.trainer.tracking import MLflowTracker, Progress, flatten

log = logging.getLogger("loom.trainer")


class TaskError(ConfigError):
    """The user's entrypoint cannot be loaded or is not a TrainTask (permanent)."""


def load_task(entrypoint: str) -> TrainTask:
    module_name, _, attribute = entrypoint.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise TaskError(f"entrypoint {entrypoint!r} cannot be loaded: {error}") from error
    if isinstance(target, type) or (not isinstance(target, TrainTask) and callable(target)):
        target = target()
    if not isinstance(target, TrainTask):
        raise TaskError(f"entrypoint {entrypoint!r} is {type(target).__name__}, not a TrainTask")
    return target


def emit(event: str, **fields: Any) -> None:
    """One JSON line per event on stdout (rank 0): structured logs that tests and humans can read."""
    print(json.dumps({"event": event, **fields}), flush=True)


class StopFlag:
    """Set by SIGTERM; ranks agree on stopping through the per-step all-reduce."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device(config: TrainerConfig, local_rank: int) -> torch.device:
    wanted = config.training.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_process_group(backend: str, rank: int, world: int, restart: int) -> None:
    """Join the process group through torchrun's store, namespaced by the restart count.

    After an elastic restart the agent can hand out the same store; without a per-attempt namespace the new
    workers may read the dead workers' gloo addresses and fail to connect.
    """
    timeout = timedelta(minutes=10)
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (address and port):
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
        return
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(address, int(port), world, is_master=(not agent_hosts_store and rank == 0),
                          timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"loom/attempt-{restart}", store),
                            rank=rank, world_size=world, timeout=timeout)


def run(config: TrainerConfig) -> int:
    stop = StopFlag()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    task = load_task(config.entrypoint)
    device = _device(config, local_rank)
    if device.type == "cpu":
        # DeepSpeed otherwise probes for accelerators and may try to build CUDA ops.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        _init_process_group(backend, rank, world, restart)
    training = config.training
    ctx = TaskContext(rank, world, local_rank, str(device), training.seed, training.batch_size, training.task_args)

    # Same seed on every rank: identical initial weights before sharding.
    _seed_everything(training.seed)
    model = task.build_model(ctx)
    flops_per_token = task.flops_per_token(model)
    engine = build_engine(config, task, model, device)
    data = task.build_data(ctx)
    _seed_everything(training.seed + rank)  # per-rank streams (dropout) from here on

    session = [new_session_id() if rank == 0 else ""]
    dist.broadcast_object_list(session, src=0)
    progress = Progress(config.progress, training.max_steps) if rank == 0 else None
    manager: CheckpointManager | None = None
    if config.checkpoint:
        manager = CheckpointManager(
            config.checkpoint, rank, world, config.engine.value, session[0],
            on_commit=(lambda m, uri: _committed(progress, tracker, m.step, uri)) if rank == 0 else None,
        )

    restored: Restored | None = None
    if manager:
        target = manager.resolve_resume()
        if target:
            engine.prime(task.move_batch(data.batch(0, rank, world, training.batch_size), str(device)))
            restored = manager.load(*target, engine.load_checkpoint_state)
            engine.scheduler.load_state_dict(restored.trainer_state["scheduler"])
            # load_state_dict restores the schedule's position but not the optimizer's current lr, which
            # the DeepSpeed state (weights and moments only) does not carry: set it from the schedule.
            for group, lr in zip(engine.scheduler.optimizer.param_groups, engine.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
            if hasattr(data, "load_state_dict") and restored.trainer_state.get("data") is not None:
                data.load_state_dict(restored.trainer_state["data"])
    start_step = restored.step if restored else 0

    tracker: MLflowTracker | None = None
    if rank == 0 and config.tracking.mlflow:
        previous_run = restored.trainer_state.get("mlflowRunId") if restored else None
        tracker = MLflowTracker(config.tracking.mlflow, run_id=previous_run)
        tracker.log_params({**flatten("", config.model_dump(mode="json", by_alias=True)), "worldSize": world})
        if restored:
            tracker.set_tag(f"loom.resume.{restart}", f"{restored.uri}@{restored.step}")
    if rank == 0:
        emit("start", rank=rank, worldSize=world, restart=restart, engine=config.engine.value, startStep=start_step,
             resumedFrom=restored.uri if restored else None)
        if restored:
            emit("resume", step=restored.step, uri=restored.uri, worldSize=world)
            if progress:
                progress.checkpoint_restored(restored.uri, restored.step, restored.committed_at)

    def trainer_state(step: int) -> dict[str, Any]:
        return {
            "step": step,
            "samplesSeen": step * training.batch_size * world,
            "scheduler": engine.scheduler.state_dict(),
            "data": data.state_dict() if hasattr(data, "state_dict") else None,
            "seed": training.seed,
            "worldSize": world,
            "mlflowRunId": tracker.run_id if tracker else None,
        }

    def checkpoint(step: int, final: bool) -> None:
        assert manager is not None
        stall = manager.save(step, engine.checkpoint_state(), trainer_state(step), block=final)
        if progress:
            progress.stalled(stall)
        if rank == 0:
            emit("checkpoint", step=step, stallSeconds=round(stall, 4), final=final)

    tokens_per_sample = _tokens_per_sample(data, ctx)
    window_start, window_steps = time.perf_counter(), 0
    step = start_step
    loss_value = float("nan")
    interrupted = False
    for step in range(start_step + 1, training.max_steps + 1):
        batch = task.move_batch(data.batch(step, rank, world, training.batch_size), str(device))
        output = engine.step(batch)
        # One all-reduce per step: mean loss for logging, the stop vote and the time-based checkpoint vote.
        time_due = bool(manager and manager.due_by_time())
        vote = torch.tensor([float(output.loss), float(stop.requested), float(time_due)], device=device)
        dist.all_reduce(vote)
        loss_value = float(vote[0]) / world
        stopping = bool(vote[1] > 0)
        checkpoint_due = bool(manager and (manager.due_by_steps(step) or vote[2] > 0))
        window_steps += 1
        elapsed = time.perf_counter() - window_start
        if rank == 0 and (step % training.log_every_steps == 0 or stopping or step == training.max_steps):
            samples_per_second = window_steps * training.batch_size * world / max(elapsed, 1e-9)
            eta = (training.max_steps - step) * training.batch_size * world / max(samples_per_second, 1e-9)
            metrics = {"loss": loss_value, "samples_per_second": samples_per_second,
                       "lr": engine.scheduler.get_last_lr()[0], **output.metrics}
            if tokens_per_sample and flops_per_token:
                metrics["tokens_per_second"] = samples_per_second * tokens_per_sample
            emit("step", step=step, loss=round(loss_value, 6), samplesPerSecond=round(samples_per_second, 2))
            if progress:
                progress.update(step, loss_value, samples_per_second, eta, "Running")
            if tracker:
                tracker.log_metrics(metrics, step)
            window_start, window_steps = time.perf_counter(), 0
        if stopping:
            interrupted = True
            break
        if checkpoint_due and step != training.max_steps:
            checkpoint(step, final=False)

    if manager:
        if config.checkpoint and config.checkpoint.save_final and manager.last_saved_step != step and step > 0:
            checkpoint(step, final=True)
        manager.close()
    if interrupted:
        if rank == 0:
            emit("interrupted", step=step)
            if progress:
                progress.finish("Interrupted")
            if tracker:
                tracker.flush()
        dist.destroy_process_group()
        return EXIT_INTERRUPTED

    _export_final_model(config, task, engine, rank, tracker)
    if rank == 0:
        emit("done", step=step, loss=round(loss_value, 6))
        if progress:
            progress.finish("Succeeded")
        if tracker:
            tracker.end("FINISHED")
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_OK


def _committed(progress: Progress | None, tracker: MLflowTracker | None, step: int, uri: str) -> None:
    if progress:
        progress.checkpoint_committed(uri, step)
    if tracker:
        tracker.set_tag("loom.checkpoint.latest", uri)
        tracker.log_metrics({"checkpoint_step": float(step)}, step)
    emit("committed", step=step, uri=uri)


def _tokens_per_sample(data: Any, ctx: TaskContext) -> int | None:
    return int(getattr(data, "block_size", 0)) or None


def _export_final_model(config: TrainerConfig, task: TrainTask, engine: Any, rank: int,
                        tracker: MLflowTracker | None) -> None:
    """Full weights + config.json: to <output uri> in S3 and as the MLflow run's `model` artifact."""
    destination = config.output_uri()
    want_mlflow = tracker is not None and config.tracking.mlflow is not None and config.tracking.mlflow.log_model
    if not destination and not want_mlflow:
        return
    state = engine.full_model_state()  # collective
    if rank != 0:
        return
    with tempfile.TemporaryDirectory(prefix="loom-export-") as folder_name:
        folder = Path(folder_name)
        torch.save(state, folder / "model.pt")
        (folder / "config.json").write_text(json.dumps(task.export_config(engine.model), indent=1))
        if destination:
            client = make_client(config.checkpoint.endpoint if config.checkpoint else None)
            root = S3Location.parse(destination)
            for path in folder.iterdir():
                upload_file(client, path, root.child(path.name))
            emit("exported", uri=destination)
        if want_mlflow and tracker is not None:
            tracker.log_artifacts(folder, "model")
            if destination:
                tracker.set_tag("loom.model.uri", destination)
