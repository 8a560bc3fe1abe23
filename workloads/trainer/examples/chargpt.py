"""Bundled example: a small character-level GPT trained on a public-domain text shipped with Loom.

Also what the model server loads: `load_for_inference(folder)` rebuilds the model from the files the
trainer's final export writes (`config.json` + `model.pt`), and `generate` samples text from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..task import TaskContext, TrainTask

# A fixed vocabulary (newline + printable ASCII) so encode/decode never depend on the training text.
VOCAB: str = "\n" + "".join(chr(code) for code in range(32, 127))
_INDEX = {char: index for index, char in enumerate(VOCAB)}
_UNKNOWN = _INDEX["?"]
WEIGHTS_FILE = "model.pt"
CONFIG_FILE = "config.json"


def encode(text: str) -> list[int]:
    return [_INDEX.get(char, _UNKNOWN) for char in text]


def decode(tokens: list[int] | torch.Tensor) -> str:
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return "".join(VOCAB[i] if 0 <= i < len(VOCAB) else "?" for i in ids)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = len(VOCAB)
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        known = {key: value for key, value in values.items() if key in cls.__dataclass_fields__}
        return cls(**known)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, time, channels))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        # Untied head: tied weights would share one parameter between two FSDP units.
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def generate(
    model: GPT,
    prompt: str,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> str:
    """Sample a continuation of `prompt` (returns only the new text)."""
    model.eval()
    device = next(model.parameters()).device
    block = model.config.block_size
    idx = torch.tensor([encode(prompt) or [_INDEX["\n"]]], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block:])[:, -1, :].float()
        if temperature <= 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                threshold = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, next_id], dim=1)
        new.append(int(next_id.item()))
    return decode(new)


def load_for_inference(folder: str | Path, device: str = "cpu") -> GPT:
    """Rebuild the model from a final-model export (config.json + model.pt) for serving."""
    folder = Path(folder)
    exported = json.loads((folder / CONFIG_FILE).read_text())
    model = GPT(GPTConfig.from_dict(exported.get("model", exported)))
    state = torch.load(folder / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.to(device).eval()


def training_text() -> str:
    return (resources.files("loom.workloads.trainer.examples") / "data" / "tom_sawyer.txt").read_text()


class CharData:
    """Random windows of the text; each (step, rank) draws from its own seeded generator, so a batch is
    a pure function of its position and a resumed run sees exactly the batches it would have seen."""

    def __init__(self, tokens: torch.Tensor, block_size: int, seed: int) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.seed = seed

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((self.seed, step, rank, world_size)) & 0x7FFFFFFF)
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([self.tokens[s : s + self.block_size] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1 : s + 1 + self.block_size] for s in starts.tolist()])
        return x, y


class CharGPTTask(TrainTask):
    """taskArgs: any GPTConfig field (blockSize/block_size, nLayer, nHead, nEmbd, dropout) and `text`
    (a path to a different training text)."""

    def _config(self, args: dict[str, Any]) -> GPTConfig:
        snake = {_to_snake(key): value for key, value in args.items()}
        return GPTConfig.from_dict(snake)

    def build_model(self, ctx: TaskContext) -> nn.Module:
        return GPT(self._config(ctx.args))

    def build_data(self, ctx: TaskContext) -> CharData:
        text_path = ctx.args.get("text")
        text = Path(text_path).read_text() if text_path else training_text()
        tokens = torch.tensor(encode(text), dtype=torch.long)
        return CharData(tokens, self._config(ctx.args).block_size, ctx.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(_gpt(model).blocks)

    def export_config(self, model: nn.Module) -> dict[str, Any]:
        return {"architecture": "chargpt", "model": asdict(_gpt(model).config)}

    def flops_per_token(self, model: nn.Module) -> float:
        config = _gpt(model).config
        # Embedding lookups are not matmuls: count every other weight (the head included).
        params = sum(p.numel() for name, p in model.named_parameters() if "_emb." not in name)
        # 6N for the matmuls with weights plus attention's QK^T and AV (PaLM appendix B).
        return 6.0 * params + 12.0 * config.n_layer * config.n_embd * config.block_size


def _gpt(model: nn.Module) -> GPT:
    """The task's hooks receive the model build_model made (FSDP2 keeps it a GPT subclass)."""
    if not isinstance(model, GPT):
        raise TypeError(f"the chargpt task expects its own GPT model, got {type(model).__name__}")
    return model


def _to_snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def initial_loss() -> float:
    """Loss of a uniform guess over the vocabulary: where an untrained model starts."""
    return math.log(len(VOCAB))


task = CharGPTTask()
