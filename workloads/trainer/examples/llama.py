"""Bundled example: a small Llama-architecture model trained on the public-domain text Loom ships, exported in
Hugging Face format (config.json, model.safetensors, tokenizer files) that the vllm runtime serves.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on that same text (nothing from a hub);
the module names its parameters as Hugging Face's ``LlamaForCausalLM`` does, so the trained state dict is the
export, as it is. taskArgs: hiddenSize, numLayers, numHeads, numKvHeads, intermediateSize, vocabSize,
maxPositions (loom.workloads.llm.hf_model.LlamaShape; head dimension 64 by default, which vLLM's CPU kernels
need), blockSize (training window) and text (a path to another training text).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...llm.hf_model import LlamaShape, example_text, train_tokenizer, write_llama_folder
from ..task import TaskContext, TrainTask

RMS_EPS = 1e-5
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)).type_as(x) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        # Rotary embedding in Hugging Face's (and vLLM's neox-style) layout: halves, not interleaved pairs.
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaBody(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)


class Llama(nn.Module):
    """LlamaForCausalLM's computation with its parameter names (``model.*``; the output head is tied)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape)
        for name, param in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        d = self.shape.head_dim
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=idx.device, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(t, device=idx.device, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype))
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)


@torch.no_grad()
def greedy(model: Llama, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation (no KV cache: the reference the served model's greedy output is compared with)."""
    out = list(ids)
    for _ in range(new_tokens):
        logits = model(torch.tensor([out[-model.shape.max_positions:]]))
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


class TokenData:
    """Random windows of the tokenized text; a batch is a pure function of (seed, step, rank, world size)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, seed: int) -> None:
        self.tokens, self.block_size, self.seed = tokens, block_size, seed

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((self.seed, step, rank, world_size)) & 0x7FFFFFFF)
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (batch_size,), generator=generator).tolist()
        x = torch.stack([self.tokens[s : s + self.block_size] for s in starts])
        y = torch.stack([self.tokens[s + 1 : s + 1 + self.block_size] for s in starts])
        return x, y


_SHAPE_ARGS = {f.name: "".join(p.title() if i else p for i, p in enumerate(f.name.split("_")))
               for f in dataclasses.fields(LlamaShape)}


def shape_of(args: dict[str, Any]) -> LlamaShape:
    return LlamaShape(**{name: int(args[camel]) for name, camel in _SHAPE_ARGS.items() if camel in args})


def shape_from_folder(folder: str | Path) -> LlamaShape:
    """The shape a Hugging Face Llama folder's config.json describes (spec.finetune's base model)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"the base model is a {config.get('model_type')!r}, not a llama: this task builds Llamas")
    return LlamaShape(
        vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]), num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads", config["num_attention_heads"])),
        intermediate_size=int(config["intermediate_size"]),
        max_positions=int(config.get("max_position_embeddings", 512)),
    )


class LlamaTask(TrainTask):
    """Exports in Hugging Face format (export_files): the folder the vllm runtime serves."""

    text: str | None = None  # the training text, set by build_data: the export's tokenizer is trained on it too

    def _text(self, args: dict[str, Any]) -> str:
        return Path(args["text"]).read_text() if args.get("text") else example_text()

    def build_model(self, ctx: TaskContext) -> nn.Module:
        # Fine-tuning: the base model's architecture (the trainer loads its weights into it).
        return Llama(shape_from_folder(ctx.base_model) if ctx.base_model else shape_of(ctx.args))

    def build_data(self, ctx: TaskContext) -> TokenData:
        shape = shape_from_folder(ctx.base_model) if ctx.base_model else shape_of(ctx.args)
        text = self.text = self._text(ctx.args)
        # Fine-tuning reads the text with the base model's own tokenizer: its token ids are the ones it learned.
        tokenizer: Any = base_tokenizer(ctx.base_model) if ctx.base_model else train_tokenizer(
            text.splitlines(), shape.vocab_size)
        tokens = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
        block = int(ctx.args.get("blockSize", 64))
        return TokenData(tokens, min(block, shape.max_positions), ctx.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(_llama(model).model.layers)

    def export_config(self, model: nn.Module) -> dict[str, Any]:
        return {"architecture": "llama", "shape": dataclasses.asdict(_llama(model).shape)}

    def export_files(self, state: dict[str, torch.Tensor], describe: dict[str, Any], folder: Path) -> bool:
        """The Hugging Face folder: the state dict as it is (its names are Hugging Face's), float32 safetensors,
        and the tokenizer trained on the same text, so token ids match the ones the model learned."""
        shape = LlamaShape(**describe["shape"])
        weights = {name: tensor.detach().float().cpu().numpy() for name, tensor in state.items()}
        write_llama_folder(folder, shape, weights, text=self.text)
        (folder / "loom-export.json").write_text(json.dumps(describe))
        return True


def base_tokenizer(folder: str | Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def _llama(model: nn.Module) -> Llama:
    if not isinstance(model, Llama):
        raise TypeError(f"the llama task expects its own Llama model, got {type(model).__name__}")
    return model


task = LlamaTask()
