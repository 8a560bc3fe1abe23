"""The vllm runtime serving an embedding model: Loom's front (python -m loom.workloads.llm) over the real vLLM engine
with its pooling runner (``--runner=pooling --convert=embed`` in the engine's extra args) on a tiny Llama, asked
with the official ``openai`` client's ``embeddings.create`` and an API key, as a FeatureView's materialization and
a retrieval step do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from loom.devstack.servers import free_port
from loom.workloads.llm.config import EngineOptions, LlmLimits, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python
from loom.workloads.server.config import AuthConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-embed"
SHAPE = LlamaShape()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("embed")
    write_llama_folder(folder / "model", SHAPE, seed=1)
    config = LlmServerConfig(
        model_name=MODEL, model_dir=str(folder / "model"), host="127.0.0.1", port=free_port(),
        engine_port=free_port(), engine_python=vllm_python(REPO),
        engine=EngineOptions(max_model_len=256, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                             extra_args=["--runner=pooling", "--convert=embed"]),
        auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"),
        limits=LlmLimits(tokens_per_minute=100_000, max_tokens_limit=64),
    )
    with llm_server(config, folder, env={"LOOM_TEST_KEYS": "k-embed"}) as ready:
        yield ready


def client(url: str, key: str = "k-embed") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_embeddings_through_the_front_with_the_openai_client(url: str) -> None:
    texts = ["The cat sat on the mat.", "Dogs bark at night.", "The cat sat on the mat."]
    answer = client(url).embeddings.create(model=MODEL, input=texts)
    vectors = np.array([item.embedding for item in answer.data])
    assert answer.model == MODEL and vectors.shape == (3, SHAPE.hidden_size)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(1.0, abs=1e-4)  # --convert embed normalizes
    assert np.allclose(vectors[0], vectors[2], atol=1e-5) and not np.allclose(vectors[0], vectors[1], atol=1e-3)
    assert answer.usage.prompt_tokens > 0


def test_a_missing_key_and_another_model_are_refused(url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").embeddings.create(model=MODEL, input=["x"])
    with pytest.raises(openai.NotFoundError, match="model 'other' is not served here"):
        client(url).embeddings.create(model="other", input=["x"])
