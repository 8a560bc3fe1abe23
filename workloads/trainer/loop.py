"""The training run inside one torchrun worker: set up, resume, train, checkpoint, export, stop cleanly.

What rank 0 tells the outside world (events, progress, MLflow, the published model, the exit message) is
`duties.Rank0Duties`; every other rank holds a `Duties` that does nothing, so this module never branches on
the rank for reporting.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import random
import signal
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from .checkpoint.manager import CheckpointManager, Restored, new_session_id
from .config import EXIT_INTERRUPTED, EXIT_OK, ConfigError, FinetuneSpec, TrainerConfig
from .duties import Duties, ExportWriter, duties_for, emit
from .engines import Engine, build_engine
from .finetune import apply_lora, fetch_base_model, frozen_digest, load_base_weights, write_adapter
from .task import DataSource, TaskContext, TrainTask

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


class StopFlag:
    """Set by SIGTERM; ranks agree on stopping through the per-step all-reduce."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
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
    # torch.distributed re-exports TCPStore from its C extension without declaring it public to type checkers.
    store = dist.TCPStore(address, int(port), world,  # type: ignore[attr-defined]
                          is_master=(not agent_hosts_store and rank == 0), timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend=backend, store=PrefixStore(f"loom/attempt-{restart}", store),
                            rank=rank, world_size=world, timeout=timeout)


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the job, as torchrun tells it."""

    rank: int
    world: int
    local: int
    restart: int  # how often torchrun restarted the workers of this gang
    attempt: int = 0  # which gang this is (the operator's LOOM_GANG_ATTEMPT; 0 for the first)

    @classmethod
    def from_env(cls) -> Ranks:
        env = os.environ
        return cls(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
                   int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), int(env.get("LOOM_GANG_ATTEMPT", "0")))


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over all ranks
    stopping: bool  # some rank got SIGTERM
    checkpoint_due: bool  # by steps, or by some rank's clock


class Training:
    """One rank's run, set up: the process group, the task's model and data, the engine, the checkpoint
    manager and the rank's duties."""

    def __init__(self, config: TrainerConfig, ranks: Ranks, stop: StopFlag) -> None:
        self.config, self.ranks, self.stop = config, ranks, stop
        self.task = load_task(config.entrypoint)
        if config.output.format == "huggingface" and type(self.task).export_files is TrainTask.export_files:
            # Known now, not after hours of training.
            raise ConfigError(f"output.format huggingface: the task {type(self.task).__name__} has no Hugging Face "
                              "export (TrainTask.export_files)")
        self.device = _device(config, ranks.local)
        if self.device.type == "cpu":
            # DeepSpeed otherwise probes for accelerators and may try to build CUDA ops.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            _init_process_group(backend, ranks.rank, ranks.world, ranks.restart)
        training = config.training
        base = _fetch_base_model(config, ranks) if config.finetune else None
        ctx = TaskContext(ranks.rank, ranks.world, ranks.local, str(self.device), training.seed,
                          training.batch_size, training.task_args, base_model=str(base) if base else None)
        # Same seed on every rank: identical initial weights (and LoRA initialisation) before sharding.
        _seed_everything(training.seed)
        model = self.task.build_model(ctx)
        if config.finetune is not None and base is not None:
            load_base_weights(model, base)
            model = apply_lora(model, config.finetune)
        flops_per_token = self.task.flops_per_token(model)
        self.engine: Engine = build_engine(config, self.task, model, self.device)
        self.base_digest = frozen_digest(self.engine.model) if config.finetune else None
        self.data: DataSource = self.task.build_data(ctx)
        _seed_everything(training.seed + ranks.rank)  # per-rank streams (dropout) from here on

        tokens_per_sample = int(getattr(self.data, "block_size", 0)) or None
        self.duties: Duties = duties_for(ranks.rank, config, ranks.world, ranks.restart,
                                         tokens_per_sample if flops_per_token else None, attempt=ranks.attempt)
        session = [new_session_id() if ranks.rank == 0 else ""]
        dist.broadcast_object_list(session, src=0)
        self.manager = (
            CheckpointManager(config.checkpoint, ranks.rank, ranks.world, config.engine.value, session[0],
                              on_commit=lambda manifest, uri: self.duties.checkpoint_committed(manifest.step, uri),
                              on_failure=lambda step, error: self.duties.checkpoint_retrying(step, error))
            if config.checkpoint else None
        )

    def batch(self, step: int) -> Any:
        training, ranks = self.config.training, self.ranks
        return self.task.move_batch(self.data.batch(step, ranks.rank, ranks.world, training.batch_size),
                                    str(self.device))

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the last step it covers (0 when fresh)."""
        restored = self._restore() if self.manager else None
        start_step = restored.step if restored else 0
        self.duties.begin(start_step, restored)
        return start_step

    def _restore(self) -> Restored | None:
        assert self.manager is not None
        target = self.manager.resolve_resume()
        if target is None:
            return None
        engine = self.engine
        engine.prime(self.batch(0))
        restored = self.manager.load(*target, engine.load_checkpoint_state)
        engine.scheduler.load_state_dict(restored.trainer_state["scheduler"])
        # load_state_dict restores the schedule's position but not the optimizer's current lr, which
        # the DeepSpeed state (weights and moments only) does not carry: set it from the schedule.
        for group, lr in zip(engine.scheduler.optimizer.param_groups, engine.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        data_state = restored.trainer_state.get("data")
        if hasattr(self.data, "load_state_dict") and data_state is not None:
            self.data.load_state_dict(data_state)
        return restored

    def step(self, step: int) -> StepResult:
        output = self.engine.step(self.batch(step))
        manager, world = self.manager, self.ranks.world
        # One all-reduce per step: mean loss for logging, the stop vote and the time-based checkpoint vote.
        time_due = bool(manager and manager.due_by_time())
        vote = torch.tensor([float(output.loss), float(self.stop.requested), float(time_due)], device=self.device)
        dist.all_reduce(vote)
        loss = float(vote[0]) / world
        self.duties.stepped(step, loss, float(self.engine.scheduler.get_last_lr()[0]), output.metrics,
                            stopping=bool(vote[1] > 0))
        return StepResult(loss=loss, stopping=bool(vote[1] > 0),
                          checkpoint_due=bool(manager and (manager.due_by_steps(step) or vote[2] > 0)))

    def trainer_state(self, step: int) -> dict[str, Any]:
        training, data = self.config.training, self.data
        return {
            "step": step,
            "samplesSeen": step * training.batch_size * self.ranks.world,
            "scheduler": self.engine.scheduler.state_dict(),
            "data": data.state_dict() if hasattr(data, "state_dict") else None,
            "seed": training.seed,
            "worldSize": self.ranks.world,
            "mlflowRunId": self.duties.mlflow_run_id,
        }

    def checkpoint(self, step: int, final: bool = False) -> None:
        assert self.manager is not None
        stall = self.manager.save(step, self.engine.checkpoint_state(), self.trainer_state(step), block=final)
        self.duties.checkpoint_saved(step, stall, final)

    def finish(self, step: int, loss: float, interrupted: bool) -> int:
        """The final checkpoint (unless the last one already covers `step`), then export and stop."""
        manager, spec = self.manager, self.config.checkpoint
        if manager:
            if spec and spec.save_final and manager.last_saved_step != step and step > 0:
                self.checkpoint(step, final=True)
            manager.close()
        if interrupted:
            self.duties.interrupted(step)
            dist.destroy_process_group()
            return EXIT_INTERRUPTED
        self._export_model()
        if self.base_digest is not None:
            # Every rank: its share of the frozen base is what it loaded (a stray update would show here).
            emit("frozenBase", rank=self.ranks.rank, loaded=self.base_digest, final=frozen_digest(self.engine.model))
        self.duties.finished(step, loss)
        dist.barrier()
        dist.destroy_process_group()
        return EXIT_OK

    def _export_model(self) -> None:
        config = self.config
        mlflow = config.tracking.mlflow
        # Decided from the config alone: gathering the weights is a collective every rank must enter.
        if not config.output_uri() and not (mlflow and mlflow.log_model):
            return
        finetune = config.finetune
        # Fine-tuning exports the adapter only (the trainable weights), in peft's format.
        state = self.engine.full_model_state(trainable_only=finetune is not None)
        writer: ExportWriter | None = None
        if finetune is not None:
            writer = adapter_writer(finetune)
        elif config.output.format == "huggingface":
            writer = huggingface_writer(self.task)
        self.duties.export_model(state, lambda: self.task.export_config(self.engine.model), writer)


def _fetch_base_model(config: TrainerConfig, ranks: Ranks) -> Path:
    """One process per node downloads the base model; every rank learns whether it could (a ConfigError on one
    node fails all of them, instead of leaving the others waiting in a collective)."""
    assert config.finetune is not None
    problem = ""
    if ranks.local == 0:
        try:
            fetch_base_model(config.finetune, config.checkpoint.endpoint if config.checkpoint else None)
        except ConfigError as error:
            problem = str(error)
        except Exception as error:  # storage or registry trouble: retryable, but every rank must hear of it
            problem = f"retryable: {type(error).__name__}: {error}"
    problems: list[str] = [""] * ranks.world
    dist.all_gather_object(problems, problem)
    for found in problems:
        if found.startswith("retryable: "):
            raise RuntimeError(f"fetching the base model: {found.removeprefix('retryable: ')}")
        if found:
            raise ConfigError(found)
    return Path(config.finetune.cache_dir)


def adapter_writer(spec: FinetuneSpec) -> ExportWriter:
    def write(state: dict[str, torch.Tensor], describe: dict[str, Any], folder: Path) -> bool:
        write_adapter(spec, state, folder)
        return True

    return write


def huggingface_writer(task: TrainTask) -> ExportWriter:
    """The task's own export, which must write something: a task without a Hugging Face export fails loudly
    rather than export model.pt where a Hugging Face folder was asked for."""

    def write(state: dict[str, torch.Tensor], describe: dict[str, Any], folder: Path) -> bool:
        if not task.export_files(state, describe, folder):
            raise ValueError(f"output.format huggingface: the task {type(task).__name__} has no Hugging Face "
                             "export (TrainTask.export_files)")
        return True

    return write


def run(config: TrainerConfig) -> int:
    training = Training(config, Ranks.from_env(), StopFlag())
    start = step = training.resume()
    loss = math.nan
    for step in range(start + 1, config.training.max_steps + 1):
        result = training.step(step)
        loss = result.loss
        if result.stopping:
            return training.finish(step, loss, interrupted=True)
        # The last step's checkpoint is the final one, written (blocking) by finish.
        if result.checkpoint_due and step != config.training.max_steps:
            training.checkpoint(step)
    return training.finish(step, loss, interrupted=False)
