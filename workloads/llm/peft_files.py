"""A LoRA adapter in peft's on-disk format (adapter_config.json, adapter_model.safetensors) for a Llama of a
given shape, drawn at random with numpy: no torch, no peft, no base weights needed.

The local stack seeds the adapters `examples/inferenceservice-llama-vllm-adapters.yaml` names with these, so the
example runs as written (`loom dev up` starts its S3 server empty). An adapter only has to match the shapes of
the modules it targets, not the base's weights, so one drawn for the `llama` example's shape loads into vLLM
on top of whatever that example's TrainingJob trained. The tensor names are peft's, as `save_pretrained` writes
them for `LlamaForCausalLM` (`tests/unit/test_peft_files.py` compares them with peft's own output).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .hf_model import LlamaShape

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The projections a LoRA adapter usually targets, by their place in a Llama decoder layer.
MODULE_PATHS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def lora_tensor_shapes(shape: LlamaShape, rank: int, targets: tuple[str, ...] = DEFAULT_TARGETS,
                       ) -> dict[str, tuple[int, int]]:
    """peft's tensor names and shapes: lora_A is (rank, in features), lora_B is (out features, rank)."""
    unknown = sorted(set(targets) - set(MODULE_PATHS))
    if unknown:
        raise ValueError(f"not a Llama projection: {unknown}; choose from {sorted(MODULE_PATHS)}")
    weights = shape.weight_shapes()
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(shape.num_layers):
        for module in targets:
            name = f"model.layers.{layer}.{MODULE_PATHS[module]}.{module}"
            out_features, in_features = weights[f"{name}.weight"]
            shapes[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (rank, in_features)
            shapes[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (out_features, rank)
    return shapes


def write_random_adapter(dest: Path, shape: LlamaShape, seed: int, rank: int = 8, scale: float = 0.3,
                         targets: tuple[str, ...] = DEFAULT_TARGETS, base_model: str = "") -> Path:
    """Write an adapter whose A and B are both drawn at ``scale`` (peft starts B at zero, which would change
    nothing), so it changes what the model says; ``seed`` makes two adapters differ."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {name: rng.normal(0.0, scale, size=dims).astype(np.float32)
               for name, dims in lora_tensor_shapes(shape, rank, targets).items()}
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (dest / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None, "use_rslora": False,
        "use_dora": False,
    }, indent=1))
    return dest
