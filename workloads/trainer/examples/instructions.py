"""Bundled example: LoRA fine-tuning of a Hugging Face Llama (spec.finetune's base model, e.g. the one the llama example
exports) on a small instruction data set that this module generates (nothing is downloaded).

The data set: short instructions with one right answer each (capitals, opposites, colours, counting, adding small
numbers), drawn from fixed tables by a seed, so it is the same on every rank and every run. Each pair is written in
the base model's chat template (loom.workloads.llm.hf_model.CHAT_TEMPLATE, which vLLM applies to a chat completion),
tokenized with the base model's own tokenizer, and only the answer's tokens count in the loss: the adapter learns to
answer, not to repeat questions.

taskArgs: examples (how many pairs, default 512), dataSeed (default 0), blockSize (longest sequence, default 64),
data (a JSON-lines file of {"instruction", "response"} objects instead of the generated set).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...llm.hf_model import EOS
from ..task import TaskContext
from .llama import LlamaTask, base_tokenizer

IGNORE = -100

CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Japan": "Tokyo", "Egypt": "Cairo",
    "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo", "Greece": "Athens", "Cuba": "Havana", "Chile": "Santiago",
}
OPPOSITES = {
    "hot": "cold", "up": "down", "big": "small", "fast": "slow", "day": "night", "open": "closed", "old": "new",
    "happy": "sad", "light": "dark", "early": "late", "full": "empty", "hard": "soft",
}
COLOURS = {"grass": "green", "snow": "white", "the sky": "blue", "a lemon": "yellow", "coal": "black",
           "a tomato": "red", "an orange": "orange", "chocolate": "brown"}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _pair(rng: random.Random) -> dict[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        country = rng.choice(sorted(CAPITALS))
        return {"instruction": f"What is the capital of {country}?", "response": f"The capital of {country} is "
                f"{CAPITALS[country]}."}
    if kind == 1:
        word = rng.choice(sorted(OPPOSITES))
        return {"instruction": f"What is the opposite of {word}?", "response": f"The opposite of {word} is "
                f"{OPPOSITES[word]}."}
    if kind == 2:
        thing = rng.choice(sorted(COLOURS))
        return {"instruction": f"What colour is {thing}?", "response": f"{thing.capitalize()} is {COLOURS[thing]}."}
    if kind == 3:
        start = rng.randrange(0, 7)
        end = start + rng.randrange(2, 4)
        return {"instruction": f"Count from {NUMBERS[start]} to {NUMBERS[end]}.",
                "response": " ".join(NUMBERS[start : end + 1]).capitalize() + "."}
    a, b = rng.randrange(0, 6), rng.randrange(0, 5)
    return {"instruction": f"What is {NUMBERS[a]} plus {NUMBERS[b]}?",
            "response": f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."}


def instruction_dataset(examples: int = 512, seed: int = 0) -> list[dict[str, str]]:
    """The generated instruction set: `examples` pairs, a pure function of the seed."""
    rng = random.Random(seed)
    return [_pair(rng) for _ in range(examples)]


def chat_prompt(instruction: str) -> str:
    """What the chat template makes of one user message with add_generation_prompt (as vLLM renders it)."""
    return f"<|user|>\n{instruction}{EOS}\n<|assistant|>\n"


def encode_pair(tokenizer: Any, pair: dict[str, str], block_size: int, pad_id: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one pair, padded to block_size + 1; labels are IGNORE except on the answer."""
    prompt = tokenizer.encode(chat_prompt(pair["instruction"])).ids
    answer = tokenizer.encode(f"{pair['response']}{EOS}").ids
    ids = (prompt + answer)[: block_size + 1]
    labels = ([IGNORE] * len(prompt) + answer)[: block_size + 1]
    padding = block_size + 1 - len(ids)
    return ids + [pad_id] * padding, labels + [IGNORE] * padding


class InstructionData:
    """Random pairs of the set; a batch is a pure function of (seed, step, rank, world size)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, seed: int) -> None:
        self.ids, self.labels, self.seed = ids, labels, seed
        self.block_size = ids.shape[1] - 1

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((self.seed, step, rank, world_size)) & 0x7FFFFFFF)
        rows = torch.randint(len(self.ids), (batch_size,), generator=generator)
        return self.ids[rows, :-1], self.labels[rows, 1:]


class InstructionTask(LlamaTask):
    """LoRA on a Llama base (spec.finetune): the base model's folder is required."""

    def build_data(self, ctx: TaskContext) -> InstructionData:  # type: ignore[override]
        if not ctx.base_model:
            raise ValueError("the instructions task fine-tunes a base model: set spec.finetune.baseModel")
        tokenizer = base_tokenizer(ctx.base_model)
        args = ctx.args
        if args.get("data"):
            lines = Path(str(args["data"])).read_text().splitlines()
            pairs = [json.loads(line) for line in lines if line.strip()]
        else:
            pairs = instruction_dataset(int(args.get("examples", 512)), int(args.get("dataSeed", 0)))
        block = int(args.get("blockSize", 64))
        pad = tokenizer.token_to_id("<pad>")
        encoded = [encode_pair(tokenizer, pair, block, pad if pad is not None else 0) for pair in pairs]
        ids = torch.tensor([e[0] for e in encoded], dtype=torch.long)
        labels = torch.tensor([e[1] for e in encoded], dtype=torch.long)
        return InstructionData(ids, labels, ctx.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=IGNORE)


task = InstructionTask()
