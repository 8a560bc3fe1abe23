"""The numpy-made LoRA adapters the local stack seeds: the same files peft writes, for the example's model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.numpy import load_file

from loom.devstack import backing
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_random_adapter
from loom.workloads.llm.testing import write_lora_adapter
from loom.workloads.trainer.examples.llama import shape_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_tensors_are_named_and_shaped_as_peft_writes_them(tmp_path: Path) -> None:
    shape = LlamaShape(max_positions=256)
    base = write_llama_folder(tmp_path / "base", shape)
    by_peft = load_file(str(write_lora_adapter(base, tmp_path / "peft", seed=1) / ADAPTER_WEIGHTS))
    ours = load_file(str(write_random_adapter(tmp_path / "ours", shape, seed=1) / ADAPTER_WEIGHTS))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in by_peft.items()}
    assert all(v.std() > 0.1 for v in ours.values())  # B is not zero: the adapter changes what the model says


def test_peft_reads_the_config(tmp_path: Path) -> None:
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(write_random_adapter(tmp_path, LlamaShape(), seed=3, rank=4)))
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 4, {"q_proj", "v_proj", "o_proj",
                                                                               "down_proj"})
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["peft_type"] == "LORA"


def test_two_seeds_give_two_adapters(tmp_path: Path) -> None:
    one = load_file(str(write_random_adapter(tmp_path / "a", LlamaShape(), seed=1) / ADAPTER_WEIGHTS))
    two = load_file(str(write_random_adapter(tmp_path / "b", LlamaShape(), seed=2) / ADAPTER_WEIGHTS))
    assert any((one[k] != two[k]).any() for k in one)


def test_an_unknown_target_module_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Llama projection: \\['lm_head'\\]"):
        write_random_adapter(tmp_path, LlamaShape(), seed=1, targets=("q_proj", "lm_head"))


def test_the_stack_seeds_what_the_adapters_example_names_for_the_llama_example() -> None:
    (service,) = yaml.safe_load_all((EXAMPLES / "inferenceservice-llama-vllm-adapters.yaml").read_text())
    named = {a["uri"] for a in service["spec"]["adapters"]}
    assert named == {f"s3://{backing.CHECKPOINTS_BUCKET}/{prefix}" for prefix in backing.EXAMPLE_ADAPTERS}
    assert backing.CHECKPOINTS_BUCKET in backing.BUCKETS
    # The adapters are drawn for LlamaShape(): the example job's model must have the same projections.
    (job,) = yaml.safe_load_all((EXAMPLES / "trainingjob-llama-huggingface.yaml").read_text())
    args = dict(arg.split("=", 1) for arg in job["spec"]["entrypoint"]["args"])
    trained = shape_of(args).weight_shapes()
    assert {k: v for k, v in trained.items() if "proj" in k} == {
        k: v for k, v in LlamaShape().weight_shapes().items() if "proj" in k}
    assert service["spec"]["model"]["uri"] == f"{job['spec']['checkpoint']['uri']}/final"
