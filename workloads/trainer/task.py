"""The plug-in interface between user training code and the Loom trainer.

A TrainingJob's `entrypoint` names "package.module:attribute" where the attribute is a `TrainTask`
instance, a `TrainTask` subclass, or a zero-argument factory returning one. The trainer owns everything
else: process group, engine (DeepSpeed or FSDP2), optimizer step, checkpoints, resume, tracking.

Minimal task::

    class MyTask(TrainTask):
        def build_model(self, ctx):          # plain nn.Module, on CPU, full size
            return MyModel(**ctx.args)
        def build_data(self, ctx):           # deterministic batches by step -> exact resume
            return MyData(seed=ctx.seed)
        def loss(self, model, batch):        # scalar loss (optionally with extra metrics)
            x, y = batch
            return F.cross_entropy(model(x), y)

    task = MyTask()

Contract that makes resume exact: `DataSource.batch(step, rank, world_size, batch_size)` must return the
same batch for the same arguments (derive randomness from the arguments, not from global RNG state). The
trainer saves the step (the data position) and the source's own `state_dict()` in every checkpoint.
Override `train_step` to replace the whole forward/loss computation of a step (e.g. several losses,
custom microbatching); the engine still performs backward and the optimizer step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn


@dataclass(frozen=True)
class TaskContext:
    rank: int
    world_size: int
    local_rank: int
    device: str
    seed: int
    batch_size: int
    # TrainingJob spec.training.taskArgs, passed through untouched.
    args: dict[str, Any] = field(default_factory=dict)
    # spec.finetune: the base model's Hugging Face-format folder, local. build_model builds the architecture it
    # describes (config.json) with Hugging Face's parameter names; the trainer loads the weights and freezes them.
    base_model: str | None = None


@runtime_checkable
class DataSource(Protocol):
    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Any:
        """The batch this rank trains on at `step`; a pure function of its arguments."""
        ...


@dataclass
class StepOutput:
    loss: torch.Tensor
    # Extra scalars to log (accuracy, perplexity, ...), already reduced or per-rank.
    metrics: dict[str, float] = field(default_factory=dict)


class TrainTask(ABC):
    """User training code. Subclass it and implement the three abstract methods."""

    @abstractmethod
    def build_model(self, ctx: TaskContext) -> nn.Module:
        """The full model on CPU in float32; the engine shards, casts and moves it."""

    @abstractmethod
    def build_data(self, ctx: TaskContext) -> DataSource:
        """The data source; called once per rank."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss for one batch."""

    def train_step(self, model: nn.Module, batch: Any) -> StepOutput:
        """One step's forward computation; override for custom steps."""
        return StepOutput(loss=self.loss(model, batch))

    def move_batch(self, batch: Any, device: str) -> Any:
        """Move a batch to the training device; handles tensors and (nested) tuples/lists/dicts."""
        import torch

        if isinstance(batch, torch.Tensor):
            return batch.to(device, non_blocking=True)
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.move_batch(item, device) for item in batch)
        if isinstance(batch, dict):
            return {key: self.move_batch(value, device) for key, value in batch.items()}
        return batch

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """Repeated layers: FSDP shards each one separately and activation checkpointing wraps them.

        Default: none, so the whole model is one FSDP unit and activation checkpointing is not applied.
        """
        return ()

    def export_config(self, model: nn.Module) -> dict[str, Any]:
        """JSON-serialisable description saved next to the final weights (used to rebuild the model)."""
        return {}

    def export_files(self, state: dict[str, torch.Tensor], describe: dict[str, Any], folder: Path) -> bool:
        """Write the final export in the task's own format into ``folder`` (e.g. a Hugging Face folder that the
        vllm runtime serves) and return True; the default returns False: weights as model.pt + config.json."""
        return False

    def flops_per_token(self, model: nn.Module) -> float | None:
        """Training FLOPs per token (forward + backward) for MFU reporting; None when unknown."""
        return None
