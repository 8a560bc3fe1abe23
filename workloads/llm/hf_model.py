"""A Llama-architecture model in Hugging Face format (config.json, model.safetensors, tokenizer files), made
here: a byte-level BPE tokenizer trained with the ``tokenizers`` library on text the repository ships, and
weights given by the caller (a trained state dict) or drawn at random (test fixtures and benchmarks).

What vLLM and ``transformers`` load is exactly this folder; nothing is downloaded from a hub. Needs the
``llm`` extra (tokenizers, safetensors, numpy) and no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# A ChatML-style template (Jinja, as transformers and vLLM read it from tokenizer_config.json).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")


@dataclass(frozen=True)
class LlamaShape:
    """The few numbers that make a Llama. vLLM's CPU attention kernels need a head dimension they support
    (64 works; 16 is refused), so the default is hidden 128 over 2 heads."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 512

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into num_heads, and num_heads into num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def parameters(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.weight_shapes().values())

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors of ``LlamaForCausalLM`` by their Hugging Face names (the embedding and the output
        head are tied, as small Llamas do)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,),
        }
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        return shapes

    def hf_config(self, bos_id: int, eos_id: int) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_positions,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "torch_dtype": "float32",
        }


def example_text() -> str:
    """The public-domain text the trainer's examples ship (workloads/trainer/examples/data)."""
    data = resources.files("loom.workloads.trainer.examples") / "data" / "tom_sawyer.txt"
    return data.read_text(encoding="utf-8")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> object:
    """A byte-level BPE tokenizer (GPT-2 style: every byte is representable, so no unknown token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def random_weights(shape: LlamaShape, seed: int = 0) -> dict[str, np.ndarray]:
    """Small random weights (norms at 1): a model that loads and generates, and says nothing sensible."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, dims in shape.weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(dims, dtype=np.float32)
        else:
            weights[name] = rng.normal(0.0, 0.02, size=dims).astype(np.float32)
    return weights


def write_llama_folder(
    folder: Path, shape: LlamaShape, weights: Mapping[str, np.ndarray] | None = None,
    text: str | None = None, seed: int = 0,
) -> Path:
    """Write a loadable Hugging Face Llama folder. ``weights`` (float32 arrays by Hugging Face name) must
    match ``shape``; random ones are drawn when it is None. The tokenizer is trained on ``text`` (the
    shipped example text by default) to exactly ``shape.vocab_size`` entries."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    tensors = dict(weights) if weights is not None else random_weights(shape, seed)
    expected = shape.weight_shapes()
    wrong = {k: v.shape for k, v in tensors.items() if expected.get(k) != tuple(v.shape)}
    missing = sorted(set(expected) - set(tensors))
    if wrong or missing:
        some_wrong = dict(list(wrong.items())[:3])
        raise ValueError(f"weights do not match the shape: missing {missing[:3]}, wrong {some_wrong}")
    corpus = (text if text is not None else example_text()).splitlines()
    tokenizer = train_tokenizer(corpus, shape.vocab_size)
    assert isinstance(tokenizer, Tokenizer)
    if tokenizer.get_vocab_size() != shape.vocab_size:
        raise ValueError(f"the text yields {tokenizer.get_vocab_size()} tokens, not {shape.vocab_size}: give more text")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    assert bos is not None and eos is not None  # special tokens are always in a trained vocabulary
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": False, "model_max_length": shape.max_positions, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}))
    (folder / "config.json").write_text(json.dumps(shape.hf_config(bos, eos), indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "loom-shape.json").write_text(json.dumps(asdict(shape)))
    return folder
