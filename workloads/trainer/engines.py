"""The two training engines behind one small interface: FSDP2 (`fully_shard`) and DeepSpeed ZeRO 0-3.

Both expose their state to torch.distributed.checkpoint (DCP) in a world-size independent form:
FSDP2 as sharded DTensors (DCP reshards on load); DeepSpeed as full logical tensors per parameter
(`safe_get_full_*`), which DCP de-duplicates across ranks on save so each rank writes only a share, and
which `safe_set_full_*` scatters back into whatever ZeRO partitioning the new world size has.
"""

from __future__ import annotations

import importlib
import math
import sys
from abc import ABC, abstractmethod
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from .task import StepOutput, TrainTask

if TYPE_CHECKING:
    from .config import TrainerConfig

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def lr_lambda(warmup_steps: int, max_steps: int):  # type: ignore[no-untyped-def]
    """Linear warm-up then cosine decay to 10%: a picklable-free closure, state lives in the scheduler."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Engine(ABC):
    model: nn.Module
    scheduler: LambdaLR

    @abstractmethod
    def step(self, batch: Any) -> StepOutput:
        """Forward, backward, optimizer and scheduler step; returns the (detached) loss."""

    @abstractmethod
    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state for DCP (save)."""

    @abstractmethod
    def load_checkpoint_state(self, load: Any) -> None:
        """`load(state_dict)` fills the given DCP state dict in place; apply it to model and optimizer."""

    def prime(self, batch: Any) -> None:
        """Make sure optimizer state exists before a checkpoint is loaded into it."""
        del batch  # FSDP: DCP's get_state_dict creates the optimizer state itself

    @abstractmethod
    def full_model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights on CPU, on every rank (a collective): for the final model export. trainable_only: the
        weights that train (a LoRA adapter), without the frozen base."""


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps. All of the model in full training; the adapter alone when the base is frozen
    (spec.finetune), which is also all a checkpoint then holds: the frozen base is loaded again on every start."""
    return [param for param in model.parameters() if param.requires_grad]


def has_frozen(model: nn.Module) -> bool:
    return any(not param.requires_grad for param in model.parameters())


class FSDPEngine(Engine):
    def __init__(self, config: TrainerConfig, task: TrainTask, model: nn.Module, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.task = task
        self.device = device
        spec = config.fsdp
        world = dist.get_world_size()
        blocks = list(task.blocks(model))
        if spec.activation_checkpointing and blocks:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            block_ids = {id(b) for b in blocks}
            apply_activation_checkpointing(model, check_fn=lambda m: id(m) in block_ids)
            # The wrappers replaced the blocks; find them again for sharding.
            blocks = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
        model.to(device)
        mesh_type = device.type
        if spec.sharding == "hybrid" and world > 1:
            local = torch.cuda.device_count() if device.type == "cuda" else world
            local = max(1, min(local, world))
            mesh = init_device_mesh(mesh_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(mesh_type, (world,), mesh_dim_names=("shard",))
        dtype = _DTYPES[spec.mixed_precision]
        policy = (
            MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        )
        # "none" sharding keeps parameters replicated (DDP-like) but still through FSDP2 so the state path
        # is the same; reshard_after_forward=False avoids the extra all-gathers.
        reshard = spec.sharding != "none"
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        self.model = model
        training = config.training
        # Fused AdamW on GPUs (one kernel for all parameters); foreach on CPU.
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            trainable(model),
            lr=training.learning_rate,
            weight_decay=training.weight_decay,
            fused=fused,
            foreach=not fused,
        )
        self.frozen = has_frozen(model)
        self.scheduler = LambdaLR(self.optimizer, lr_lambda(training.warmup_steps, training.max_steps))
        self.grad_clip = training.grad_clip

    def step(self, batch: Any) -> StepOutput:
        self.model.train()
        output = self.task.train_step(self.model, batch)
        output.loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(trainable(self.model), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepOutput(loss=output.loss.detach(), metrics=output.metrics)

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A frozen base is not checkpointed (it is loaded from the base model on every start): loading a state
        # without it must not count its weights as missing.
        return StateDictOptions(ignore_frozen_params=self.frozen, strict=not self.frozen)

    def checkpoint_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._options())
        return {"model": model_state, "optim": optim_state}

    def load_checkpoint_state(self, load: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.checkpoint_state()
        load(state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._options(),
        )

    def full_model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False, ignore_frozen_params=trainable_only
        )
        full: dict[str, torch.Tensor] = {}
        for name, value in get_model_state_dict(self.model, options=options).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"model state entry {name} is a {type(value).__name__}, not a tensor")
            # Activation checkpointing wrappers add a path component; exported names match the plain model.
            full[name.replace("_checkpoint_wrapped_module.", "")] = value.float()
        return full


def import_deepspeed() -> ModuleType:
    """DeepSpeed, imported without MLflow. Its autotuner (which Loom does not use) imports mlflow whenever it is
    installed, at DeepSpeed's own import: about 3.5 of its 10 CPU-seconds, on every rank of every DeepSpeed job. A
    rank that tracks to MLflow imports it itself afterwards (tracking.py), as it would have anyway."""
    hide = "mlflow" not in sys.modules and "deepspeed" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` then raises ImportError
    try:
        return importlib.import_module("deepspeed")
    finally:
        if hide and sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]


class DeepSpeedEngine(Engine):
    def __init__(self, config: TrainerConfig, task: TrainTask, model: nn.Module, device: torch.device) -> None:
        deepspeed = import_deepspeed()

        if device.type == "cpu":
            # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce (needs a compiler in the
            # image, minutes on first start); gloo through torch.distributed does the job without it.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.task = task
        spec = config.deepspeed
        training = config.training
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": training.batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": spec.zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            # torch.optim optimizers with offload: no DeepSpeedCPUAdam, so no C++ op to compile.
            "zero_force_ds_cpu_optimizer": False,
        }
        if training.grad_clip:
            ds_config["gradient_clipping"] = training.grad_clip
        if spec.bf16:
            ds_config["bf16"] = {"enabled": True}
        if spec.offload == "cpu":
            ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            if spec.zero_stage == 3:
                ds_config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        ds_config = _deep_merge(ds_config, spec.config)
        optimizer = torch.optim.AdamW(
            trainable(model), lr=training.learning_rate, weight_decay=training.weight_decay, foreach=False
        )
        scheduler = LambdaLR(optimizer, lr_lambda(training.warmup_steps, training.max_steps))
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
        )
        self.engine = engine
        self.model = engine.module
        self.ds_optimizer = ds_optimizer
        self.scheduler = ds_scheduler
        self.names = [name for name, _ in self._trained()]
        self.dtype = torch.bfloat16 if spec.bf16 else None

    def prime(self, batch: Any) -> None:
        """Torch's Adam creates its state on the first step, and ZeRO maps parameters onto it only then.
        Take one step that changes nothing (zero loss, zero learning rate) so loading has state to fill;
        the loaded checkpoint then overwrites moments, step count and schedule."""
        if self._state_keys():
            return
        base = self._base_optimizer()
        saved_lrs = [group["lr"] for group in base.param_groups]
        scheduler_state = self.scheduler.state_dict()
        for group in base.param_groups:
            group["lr"] = 0.0
        self.engine.train()
        self.engine.backward(self.task.loss(self.engine, batch) * 0.0)
        self.engine.step()
        for group, lr in zip(base.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        self.scheduler.load_state_dict(scheduler_state)

    def _link_optimizer_state(self) -> None:
        """ZeRO-1/2 and the bf16 optimizer map per-parameter views onto the optimizer state only after their
        first step; the full-state getters and setters need those views now."""
        link = getattr(self.ds_optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()

    def _trained(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters a checkpoint holds: all in full training, the adapter when the base is frozen."""
        return [(name, param) for name, param in self.model.named_parameters() if param.requires_grad]

    def _base_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.ds_optimizer, "optimizer", self.ds_optimizer)  # type: ignore[no-any-return]

    def step(self, batch: Any) -> StepOutput:
        self.engine.train()
        output = self.task.train_step(self.engine, batch)
        self.engine.backward(output.loss)
        self.engine.step()  # optimizer, zero_grad and the LR scheduler
        return StepOutput(loss=output.loss.detach().float(), metrics=output.metrics)

    def _state_keys(self) -> list[str]:
        keys: set[str] = set()
        for state in self._base_optimizer().state.values():
            keys.update(k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.dim() > 0)
        return sorted(keys)

    def _optimizer_step_count(self) -> float:
        for state in self._base_optimizer().state.values():
            if "step" in state:
                return float(state["step"])
        return 0.0

    def checkpoint_state(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._link_optimizer_state()
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, torch.Tensor] = {}
        keys = self._state_keys()
        base = self._base_optimizer()
        for name, param in self._trained():
            full = safe_get_full_fp32_param(param)
            model[name] = (full if full is not None else param.detach()).float().cpu().clone()
            for key in keys:
                value = safe_get_full_optimizer_state(param, key)
                if value is None:  # no ZeRO: the torch optimizer owns per-parameter state
                    value = base.state[param][key]
                optim[f"{name}.{key}"] = value.float().cpu().clone()
        return {"model": model, "optim": optim, "optim_step": torch.tensor(self._optimizer_step_count())}

    def load_checkpoint_state(self, load: Any) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if not self._state_keys():
            self._initialise_optimizer_state()
        state = self.checkpoint_state()
        load(state)
        base = self._base_optimizer()
        keys = self._state_keys()
        for name, param in self._trained():
            if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):
                safe_set_full_fp32_param(param, state["model"][name])
                for key in keys:
                    safe_set_full_optimizer_state(param, state["optim"][f"{name}.{key}"], key)
                # The setters only touch the fp32 master partition; the (low-precision, possibly
                # partitioned) weights the forward pass uses must be refreshed too.
                self._set_compute_weight(param, state["model"][name])
            else:
                with torch.no_grad():
                    param.copy_(state["model"][name].to(param.device, param.dtype))
                for key in keys:
                    base.state[param][key].copy_(state["optim"][f"{name}.{key}"])
        for per_param in base.state.values():
            if "step" in per_param:
                per_param["step"] = (
                    torch.as_tensor(float(state["optim_step"]), dtype=per_param["step"].dtype)
                    if torch.is_tensor(per_param["step"])
                    else float(state["optim_step"])
                )

    @staticmethod
    def _set_compute_weight(param: nn.Parameter, value: torch.Tensor) -> None:
        if hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.data.copy_(value.view_as(param.data).to(param.device, param.dtype))
        else:
            with torch.no_grad():
                param.data.copy_(value.view_as(param.data).to(param.device, param.dtype))

    def _initialise_optimizer_state(self) -> None:
        """Without ZeRO the torch optimizer creates its state lazily; create it (zeros) before loading."""
        base = self._base_optimizer()
        for group in base.param_groups:
            for param in group["params"]:
                if param not in base.state or not base.state[param]:
                    base.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }

    def full_model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, param in self._trained() if trainable_only else self.model.named_parameters():
            full = safe_get_full_fp32_param(param)
            if full is None and hasattr(param, "ds_id"):  # a frozen ZeRO-3 partition: gather it
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    full = param.detach().clone()
            state[name] = (full if full is not None else param.detach()).float().cpu().clone()
        if trainable_only:
            return state
        for name, buffer in self.model.named_buffers():
            state[name] = buffer.detach().cpu().clone()
        return state


def build_engine(config: TrainerConfig, task: TrainTask, model: nn.Module, device: torch.device) -> Engine:
    if config.engine.value == "deepspeed":
        return DeepSpeedEngine(config, task, model, device)
    return FSDPEngine(config, task, model, device)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
