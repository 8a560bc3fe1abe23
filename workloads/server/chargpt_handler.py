"""Handler for the trainer's bundled character-level GPT (loom.workloads.trainer.examples.chargpt).

Infer/generate requests carry prompts in a BYTES input ``text_input`` and get ``text_output`` back.
Prompts of a batch are generated together: rows with the same prompt length share one forward pass
per token (the model has absolute positions and no padding mask, so unequal lengths are run as
separate groups). Sampling parameters are per request: ``max_tokens`` (or ``max_new_tokens``),
``temperature`` (0 = greedy) and ``top_k``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..trainer.examples import chargpt
from .model import (
    InferRequest,
    InferResponse,
    Model,
    ModelError,
    Tensor,
    TensorSpec,
    select_outputs,
)

DEFAULT_MAX_TOKENS = 32
MAX_TOKENS_LIMIT = 4096


def save_for_serving(model: chargpt.GPT, folder: Path) -> Path:
    """Write the trainer's final-export layout (config.json + model.pt); used by tests and benchmarks."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / chargpt.CONFIG_FILE).write_text(
        json.dumps({"architecture": "chargpt", "model": asdict(model.config)})
    )
    torch.save(model.state_dict(), folder / chargpt.WEIGHTS_FILE)
    return folder


def _sampling(parameters: dict[str, Any]) -> tuple[int, float, int]:
    try:
        max_tokens = int(parameters.get("max_tokens", parameters.get("max_new_tokens", DEFAULT_MAX_TOKENS)))
        temperature = float(parameters.get("temperature", 1.0))
        top_k = int(parameters.get("top_k", 0) or 0)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"bad sampling parameter: {exc}") from exc
    if not 0 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise ModelError(f"max_tokens must be between 0 and {MAX_TOKENS_LIMIT}")
    if temperature < 0 or top_k < 0:
        raise ModelError("temperature and top_k must be >= 0")
    return max_tokens, temperature, top_k


def _next_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """One sampling step for a batch of rows, each with its own temperature and top-k."""
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-6).unsqueeze(1)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    threshold = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    sampled = torch.multinomial(F.softmax(scaled, dim=-1), 1).squeeze(1)
    return torch.where(temperature <= 0, greedy, sampled)


class CharGPTModel(Model):
    platform = "loom_chargpt"

    model: chargpt.GPT

    def load(self, folder: Path) -> None:
        device = str(self.options.get("device", "auto"))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        configs = sorted(folder.rglob(chargpt.CONFIG_FILE), key=lambda p: len(p.parts))
        shards = sorted(folder.rglob(".metadata"), key=lambda p: len(p.parts))
        if configs:
            self.model = chargpt.load_for_inference(configs[0].parent, device=device)
        elif shards:
            self.model = self._load_training_checkpoint(shards[0].parent).to(self.device).eval()
        else:
            raise FileNotFoundError(f"neither a chargpt export ({chargpt.CONFIG_FILE}) nor a checkpoint under {folder}")
        self.block_size = self.model.config.block_size

    def _load_training_checkpoint(self, checkpoint: Path) -> chargpt.GPT:
        """A sharded training checkpoint (torch.distributed.checkpoint, as the trainer writes while a job
        runs): merged into one state dict without a process group; the model's shape is read off the
        weights, and ``handlerOptions.model`` supplies what weights cannot tell (n_head)."""
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(prefix="loom-dcp-") as tmp:
            merged = Path(tmp) / "merged.pt"
            dcp_to_torch_save(str(checkpoint), str(merged))
            saved = torch.load(merged, map_location="cpu", weights_only=False)
        state = {
            key.replace("_checkpoint_wrapped_module.", ""): value.float()
            for key, value in saved.get("model", saved).items()
            if isinstance(value, torch.Tensor)
        }
        overrides = dict(self.options.get("model") or {})
        n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
        shape = {
            "vocab_size": state["tok_emb.weight"].shape[0],
            "n_embd": state["tok_emb.weight"].shape[1],
            "block_size": state["pos_emb.weight"].shape[0],
            "n_layer": n_layer,
        }
        model = chargpt.GPT(chargpt.GPTConfig.from_dict({**overrides, **shape}))
        model.load_state_dict(state)
        return model

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec("text_input", "BYTES", [-1])]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec("text_output", "BYTES", [-1])]

    @staticmethod
    def _prompts(request: InferRequest) -> list[str]:
        tensor = request.inputs.get("text_input")
        if tensor is None or tensor.datatype != "BYTES":
            raise ModelError("chargpt needs a BYTES input named 'text_input'")
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in tensor.data.reshape(-1)]

    @torch.inference_mode()
    def _generate_rows(self, rows: list[tuple[list[int], int, float, int]]) -> list[list[int]]:
        """Generate for rows of (prompt ids, max tokens, temperature, top_k) of one prompt length."""
        idx = torch.tensor([r[0] for r in rows], dtype=torch.long, device=self.device)
        temperature = torch.tensor([r[2] for r in rows], dtype=torch.float32, device=self.device)
        top_k = torch.tensor([r[3] for r in rows], dtype=torch.long, device=self.device)
        steps = max(r[1] for r in rows)
        produced = []
        for _ in range(steps):
            logits = self.model(idx[:, -self.block_size :])[:, -1, :].float()
            next_ids = _next_tokens(logits, temperature, top_k)
            produced.append(next_ids)
            idx = torch.cat([idx, next_ids.unsqueeze(1)], dim=1)
        if not produced:
            return [[] for _ in rows]
        tokens = torch.stack(produced, dim=1).cpu().tolist()
        return [t[: r[1]] for t, r in zip(tokens, rows, strict=True)]

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        results: list[InferResponse | Exception | None] = [None] * len(batch)
        groups: dict[int, list[tuple[int, int, list[int], int, float, int]]] = defaultdict(list)
        counts: dict[int, int] = {}
        for index, request in enumerate(batch):
            try:
                prompts = self._prompts(request)
                max_tokens, temperature, top_k = _sampling(request.parameters)
            except ModelError as exc:
                results[index] = exc
                continue
            counts[index] = len(prompts)
            for position, prompt in enumerate(prompts):
                ids = (chargpt.encode(prompt) or chargpt.encode("\n"))[-self.block_size :]
                groups[len(ids)].append((index, position, ids, max_tokens, temperature, top_k))
        texts: dict[int, list[str]] = {i: [""] * n for i, n in counts.items()}
        for rows in groups.values():
            generated = self._generate_rows([(r[2], r[3], r[4], r[5]) for r in rows])
            for row, ids in zip(rows, generated, strict=True):
                texts[row[0]][row[1]] = chargpt.decode(ids)
        for index, values in texts.items():
            array = np.empty(len(values), dtype=object)
            array[:] = values
            try:
                results[index] = InferResponse(
                    outputs=select_outputs(batch[index], [Tensor("text_output", "BYTES", array)])
                )
            except ModelError as exc:
                results[index] = exc
        return [r if r is not None else RuntimeError("no result") for r in results]

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        max_tokens, temperature, top_k = _sampling(parameters)
        ids = (chargpt.encode(prompt) or chargpt.encode("\n"))[-self.block_size :]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        temperatures = torch.tensor([temperature], device=self.device)
        top_ks = torch.tensor([top_k], dtype=torch.long, device=self.device)
        for _ in range(max_tokens):
            with torch.inference_mode():
                logits = self.model(idx[:, -self.block_size :])[:, -1, :].float()
                next_id = _next_tokens(logits, temperatures, top_ks)
            idx = torch.cat([idx, next_id.unsqueeze(1)], dim=1)
            yield chargpt.decode([int(next_id.item())])
