"""The trainer's Llama example: it learns, and its final export is a Hugging Face folder with the trained weights
under Hugging Face's names and the tokenizer it was trained with (vLLM serving it: test_llm_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from loom.workloads.llm.hf_model import LlamaShape
from loom.workloads.trainer.examples.llama import Llama, LlamaTask, greedy, shape_of
from loom.workloads.trainer.task import TaskContext

ARGS = {"hiddenSize": 64, "numHeads": 1, "numKvHeads": 1, "intermediateSize": 128, "vocabSize": 300,
        "maxPositions": 64, "blockSize": 32}


def context() -> TaskContext:
    return TaskContext(rank=0, world_size=1, local_rank=0, device="cpu", seed=1, batch_size=8, args=ARGS)


def test_task_args_choose_the_shape() -> None:
    assert shape_of(ARGS) == LlamaShape(vocab_size=300, hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1,
                                        intermediate_size=128, max_positions=64)


def test_the_llama_learns_and_exports_a_hugging_face_folder(tmp_path: Path) -> None:
    task, ctx = LlamaTask(), context()
    torch.manual_seed(0)
    model = task.build_model(ctx)
    assert isinstance(model, Llama)
    data = task.build_data(ctx)
    x, y = data.batch(0, 0, 1, 8)
    assert x.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        loss = task.loss(model, data.batch(step, 0, 1, 8))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # it learns the text

    folder = tmp_path / "export"
    assert task.export_files(model.state_dict(), task.export_config(model), folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 300
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())
    # The exported tokenizer is the one the model was trained with: the same ids for the same text.
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = task.text or ""
    assert tokenizer.encode(text[:2000]).ids == data.tokens[: len(tokenizer.encode(text[:2000]).ids)].tolist()
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert "add_generation_prompt" in template


def test_greedy_decoding_is_deterministic_and_uses_the_last_positions() -> None:
    torch.manual_seed(0)
    model = Llama(shape_of(ARGS)).eval()
    first, again = greedy(model, [5, 6, 7], 6), greedy(model, [5, 6, 7], 6)
    assert first == again and len(first) == 6 and all(0 <= t < 300 for t in first)
    assert greedy(model, list(range(100)), 2)  # longer than maxPositions: the window slides, no error


def test_the_huggingface_export_format_reaches_the_trainer_and_needs_a_task_that_writes_it(tmp_path: Path) -> None:
    import pytest

    from loom.operator.kinds.trainingjob.api import TrainingJobSpec
    from loom.operator.kinds.trainingjob.config import trainer_config
    from loom.workloads.trainer.examples.chargpt import CharGPTTask
    from loom.workloads.trainer.loop import huggingface_writer

    wire = {"engine": "fsdp", "entrypoint": {"module": "loom.workloads.trainer.examples.llama:task"}, "maxSteps": 5,
            "workers": {"replicas": 1}, "checkpoint": {"uri": "s3://ckpt/llama", "exportFormat": "huggingface"}}
    assert trainer_config(TrainingJobSpec.model_validate(wire)).output.format == "huggingface"
    del wire["checkpoint"]["exportFormat"]  # type: ignore[attr-defined]
    assert trainer_config(TrainingJobSpec.model_validate(wire)).output.format == "loom"
    with pytest.raises(ValueError, match="CharGPTTask has no Hugging Face export"):
        huggingface_writer(CharGPTTask())({}, {}, tmp_path)
