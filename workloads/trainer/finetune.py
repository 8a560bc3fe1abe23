"""spec.finetune inside a worker: fetch the base model, load its weights, put LoRA adapters on it (peft), and write
the adapter in peft's format.

The base model is a Hugging Face-format folder (config.json, *.safetensors, tokenizer files) from S3 or the MLflow
model registry. The task builds the architecture (``TaskContext.base_model`` is the local folder; it reads the shape
and the tokenizer from there) with Hugging Face's parameter names; the trainer loads the weights by those names and
freezes them. peft's ``inject_adapter_in_model`` then adds the low-rank matrices in place (the model stays the task's
own module, so the task's loss, blocks and the engines see the same thing as in full training). Only the adapter is
trainable, so only the adapter and its optimizer state are checkpointed; every start, resume included, loads the
frozen base again from the folder.

The export (``<checkpoint.uri>/final``) is what peft's ``save_pretrained`` writes and vLLM's ``--enable-lora`` /
``/v1/load_lora_adapter`` read: adapter_config.json and adapter_model.safetensors, whose tensor names are
``base_model.model.<the Hugging Face module path>.lora_{A,B}.weight``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.s3 import S3Location, download_tree, make_client
from ..llm.peft_files import ADAPTER_WEIGHTS, PEFT_PREFIX
from .config import ConfigError, FinetuneSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("loom.trainer.finetune")

# peft's name of the one adapter a job trains; it is not part of the exported tensor names.
ADAPTER_NAME = "default"
_MARKER = ".loom-base-model.json"


def base_source(spec: FinetuneSpec) -> str:
    """The base model's URI as the config names it (s3://... or models:/...)."""
    return spec.base_model.uri or spec.base_model.mlflow or ""


def fetch_base_model(spec: FinetuneSpec, default_endpoint: str | None) -> Path:
    """Download the base model into ``spec.cache_dir`` unless the folder already holds it (a restart on the same
    node); call it on one process per node. Raises ConfigError when the source holds no Hugging Face folder."""
    folder = Path(spec.cache_dir)
    source = base_source(spec)
    marker = folder / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("source") == source:
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    endpoint = spec.base_model.endpoint or default_endpoint
    if spec.base_model.uri is not None:
        _download_s3(spec.base_model.uri, endpoint, folder)
    else:
        _download_mlflow(spec, endpoint, folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"finetune.baseModel {source} is not a Hugging Face-format folder: no config.json in it")
    marker.write_text(json.dumps({"source": source}))
    log.info("base model %s in %s", source, folder)
    return folder


def _download_s3(uri: str, endpoint: str | None, folder: Path) -> None:
    files = download_tree(make_client(endpoint), S3Location.parse(uri), folder)
    if not files:
        raise ConfigError(f"finetune.baseModel {uri}: nothing in S3 under it")


def _download_mlflow(spec: FinetuneSpec, endpoint: str | None, folder: Path) -> None:
    """A registered model version: its source when that is in S3 (what a TrainingJob's register writes: the export
    folder), else MLflow's own artifact download."""
    from mlflow.tracking import MlflowClient

    uri = spec.base_model.mlflow or ""
    name, _, rest = uri.removeprefix("models:/").partition("/")
    client = MlflowClient(tracking_uri=spec.base_model.tracking_uri)
    if "@" in name:
        name, alias = name.split("@", 1)
        found = client.get_model_version_by_alias(name, alias)
    elif rest == "latest":
        versions = client.search_model_versions(f"name='{name}'")
        if not versions:
            raise ConfigError(f"finetune.baseModel {uri}: the registered model has no versions")
        found = max(versions, key=lambda v: int(v.version))
    else:
        found = client.get_model_version(name, rest)
    source = str(found.source or "")
    if source.startswith("s3://"):
        _download_s3(source, endpoint, folder)
        return
    from mlflow.artifacts import download_artifacts

    download_artifacts(artifact_uri=f"models:/{name}/{found.version}", dst_path=str(folder),
                       tracking_uri=spec.base_model.tracking_uri)


def load_base_weights(model: nn.Module, folder: Path) -> None:
    """The folder's safetensors into the task's model by Hugging Face name, then every weight frozen. A name the
    model has and the folder lacks (or the reverse) is a ConfigError: the adapter's names would not match the
    served model's either."""
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        names = sorted(p.name for p in folder.iterdir())
        raise ConfigError(f"the base model folder has no *.safetensors weights: {names}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - {"lm_head.weight"})  # a tied head may be stored as well
    if missing or unexpected:
        raise ConfigError(f"the base model's weights do not match the task's model (Hugging Face names): missing "
                          f"{missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, param in expected.items():
            value = state[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(f"base weight {name} has shape {tuple(value.shape)}, the model {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))
    model.requires_grad_(False)


def lora_config(spec: FinetuneSpec) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, spec: FinetuneSpec) -> nn.Module:
    """peft's LoRA layers on the frozen model, in place; only they are trainable."""
    from peft import inject_adapter_in_model

    if spec.method == "qlora":
        _quantize_base(model, spec)
    try:
        model = inject_adapter_in_model(lora_config(spec), model, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"finetune.targetModules {list(spec.target_modules)}: {error}") from error
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    if not trainable or any(".lora_" not in name for name in trainable):
        raise ConfigError(f"finetune: expected only LoRA weights to train, found {trainable[:4]}")
    return model


def _quantize_base(model: nn.Module, spec: FinetuneSpec) -> None:
    """QLoRA: the frozen target linears become bitsandbytes 4-bit (NF4) layers; peft puts its LoRA layers on those."""
    try:
        import bitsandbytes as bnb
    except ImportError as error:
        raise ConfigError("finetune.method qlora needs bitsandbytes in the worker image (pip install bitsandbytes)"
                          ) from error
    import torch
    from torch import nn

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and any(child_name == t.rsplit(".", 1)[-1] for t in spec.target_modules):
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16, quant_type="nf4")
                quantized.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                if child.bias is not None:
                    quantized.bias = nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, child_name, quantized)


def peft_tensor_name(name: str) -> str:
    """A trainable parameter's name in the model -> its name in adapter_model.safetensors."""
    for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def write_adapter(spec: FinetuneSpec, state: Mapping[str, torch.Tensor], folder: Path) -> None:
    """adapter_config.json and adapter_model.safetensors, as peft's save_pretrained writes them."""
    from safetensors.torch import save_file

    tensors = {peft_tensor_name(name): value.detach().float().cpu().contiguous()
               for name, value in state.items() if ".lora_" in name}
    if not tensors:
        raise ValueError("finetune export: the model state holds no LoRA weights")
    config = lora_config(spec)
    config.base_model_name_or_path = base_source(spec)
    config.save_pretrained(str(folder))
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / "loom-export.json").write_text(json.dumps({
        "kind": "lora-adapter", "method": spec.method, "baseModel": base_source(spec), "rank": spec.rank,
        "alpha": spec.alpha, "targetModules": list(spec.target_modules),
    }))


def frozen_digest(model: nn.Module) -> str:
    """A fingerprint of this rank's share of the frozen base weights (local shards under FSDP), taken after set-up
    and again at the end: the trainer reports both, and they must be equal. Each tensor contributes its first and
    last 64 Ki elements, so a multi-gigabyte base is fingerprinted in milliseconds; an optimizer step that touched
    a frozen weight would change all of its elements."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            flat = local.detach().reshape(-1).float().cpu()
            digest.update(name.encode())
            digest.update(flat[:65536].numpy().tobytes())
            digest.update(flat[-65536:].numpy().tobytes())
    return digest.hexdigest()[:16]
