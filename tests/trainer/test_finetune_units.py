"""The pieces of spec.finetune inside a worker, without torchrun: base weights by Hugging Face name, peft's LoRA
layers on the task's model, the adapter written in peft's format (and read back by peft), the generated instruction
set in the chat template the served model applies."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import torch

from loom.workloads.llm.hf_model import CHAT_TEMPLATE, LlamaShape, write_llama_folder
from loom.workloads.llm.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from loom.workloads.trainer.config import BaseModelSpec, ConfigError, FinetuneSpec
from loom.workloads.trainer.examples.instructions import (
    IGNORE,
    InstructionTask,
    chat_prompt,
    encode_pair,
    instruction_dataset,
)
from loom.workloads.trainer.examples.llama import Llama, base_tokenizer, shape_from_folder
from loom.workloads.trainer.finetune import (
    apply_lora,
    frozen_digest,
    load_base_weights,
    peft_tensor_name,
    write_adapter,
)
from loom.workloads.trainer.task import TaskContext

SHAPE = LlamaShape(max_positions=128)


def spec(**changes: object) -> FinetuneSpec:
    return FinetuneSpec.model_validate({"baseModel": {"uri": "s3://m/base"}, "dropout": 0.0, **changes})


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_folder(tmp_path_factory.mktemp("base"), SHAPE, seed=3)


def fine_tunable(folder: Path, finetune: FinetuneSpec) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Llama(shape_from_folder(folder))
    load_base_weights(model, folder)
    return apply_lora(model, finetune)


def test_the_base_loads_by_name_frozen_and_only_lora_trains(base_folder: Path) -> None:
    from safetensors.torch import load_file

    model = fine_tunable(base_folder, spec())
    stored = load_file(str(base_folder / "model.safetensors"))
    assert torch.equal(model.get_parameter("model.layers.1.mlp.up_proj.weight"),
                       stored["model.layers.1.mlp.up_proj.weight"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == SHAPE.num_layers * 4 * 2 and all(".lora_" in n for n in trainable)


def test_a_base_that_does_not_fit_the_task_or_targets_it_lacks_are_config_errors(
    base_folder: Path, tmp_path: Path
) -> None:
    wider = Llama(LlamaShape(hidden_size=256, max_positions=128))
    with pytest.raises(ConfigError, match="shape"):
        load_base_weights(wider, base_folder)
    model = Llama(SHAPE)
    with pytest.raises(ConfigError, match="targetModules"):
        apply_lora(model, spec(targetModules=["c_attn"]))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_base_weights(model, tmp_path)


def test_qlora_without_bitsandbytes_or_a_cpu_config_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA only"):
        from loom.workloads.trainer.config import TrainerConfig

        TrainerConfig.model_validate({"training": {"device": "cpu"},
                                      "finetune": {"method": "qlora", "baseModel": {"uri": "s3://m/b"}}})


def test_the_written_adapter_is_what_peft_reads_back_with_the_same_outputs(base_folder: Path, tmp_path: Path) -> None:
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    finetune = spec(rank=4, alpha=8, targetModules=["q_proj", "v_proj"])
    trained = fine_tunable(base_folder, finetune)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5)  # as if trained: B is zero at the start
    adapter = {n: p.detach() for n, p in trained.named_parameters() if p.requires_grad}
    write_adapter(finetune, adapter, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    saved = load_file(str(tmp_path / ADAPTER_WEIGHTS))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved

    # peft's own loader, on a fresh model (other random LoRA init): the outputs match the trained model's.
    from peft import LoraConfig

    fresh = Llama(shape_from_folder(base_folder))
    load_base_weights(fresh, base_folder)
    config = LoraConfig.from_pretrained(str(tmp_path))
    fresh = inject_adapter_in_model(config, fresh)
    result = set_peft_model_state_dict(fresh, {k.removeprefix("base_model.model."): v for k, v in saved.items()})
    assert not [k for k in result.unexpected_keys if "lora" in k]
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    trained.eval(), fresh.eval()
    assert torch.allclose(trained(ids), fresh(ids), atol=1e-5)
    base_only = Llama(shape_from_folder(base_folder))
    load_base_weights(base_only, base_folder)
    assert not torch.allclose(trained(ids), base_only(ids), atol=1e-3)  # the adapter does change the output


def test_peft_names_drop_the_adapter_name_and_wrappers() -> None:
    assert peft_tensor_name("model.layers.3.self_attn._checkpoint_wrapped_module.q_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"


def test_the_frozen_digest_sees_a_changed_base_weight(base_folder: Path) -> None:
    model = fine_tunable(base_folder, spec())
    before = frozen_digest(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.add_(1.0)  # the adapter training does not count
    assert frozen_digest(model) == before
    with torch.no_grad():
        model.get_parameter("model.layers.0.self_attn.o_proj.base_layer.weight").mul_(1.01)
    assert frozen_digest(model) != before


def test_the_instruction_set_is_generated_deterministically_in_the_served_chat_format(base_folder: Path) -> None:
    first, again = instruction_dataset(64, seed=1), instruction_dataset(64, seed=1)
    assert first == again and instruction_dataset(64, seed=2) != first
    assert len({p["instruction"] for p in first}) > 20
    # The prompt is exactly what the chat template (vLLM's rendering of a chat completion) gives.
    rendered = jinja2.Template(CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": first[0]["instruction"]}], add_generation_prompt=True)
    assert chat_prompt(first[0]["instruction"]) == rendered

    tokenizer = base_tokenizer(base_folder)
    ids, labels = encode_pair(tokenizer, first[0], 48, pad_id=0)
    prompt_len = len(tokenizer.encode(chat_prompt(first[0]["instruction"])).ids)
    assert len(ids) == len(labels) == 49
    assert all(label == IGNORE for label in labels[:prompt_len])  # the question is not learned
    answer = [label for label in labels if label != IGNORE]
    assert tokenizer.decode(answer).startswith(first[0]["response"])

    data = InstructionTask().build_data(TaskContext(0, 1, 0, "cpu", 5, 4, {"examples": 32, "blockSize": 48},
                                                    base_model=str(base_folder)))
    x, y = data.batch(3, 0, 2, 4)
    assert x.shape == y.shape == (4, 48)
    assert torch.equal(x, data.batch(3, 0, 2, 4)[0]) and not torch.equal(x, data.batch(3, 1, 2, 4)[0])


def test_base_model_spec_takes_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        BaseModelSpec()
    with pytest.raises(ValueError, match="exactly one"):
        BaseModelSpec(uri="s3://a/b", mlflow="models:/x/1")
