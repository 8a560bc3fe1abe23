"""spec.routing.prefixMatch events, end to end without an engine: the operator renders the engine's KV-events flag
(endpoint on a wildcard host), the replicas' events port and the picker's KvEventsConfig; the API refuses what
cannot work; a replica's front serves its tokenizer (as the engine uses it) without a key; the picker reads it from
the first replica that answers and tokenizes exactly as from the model's folder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import ValidationError
from starlette.testclient import TestClient

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.operator.kinds.inferenceservice.traffic.picker import picker_config, picker_policy
from loom.workloads.llm.app import build_app
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.engine import engine_argv
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.prompt_tokens import PromptTokenizer
from loom.workloads.picker.tokenizer_fetch import follow_tokenizer, switch_to, tokenizer_from_replicas
from loom.workloads.server.config import AuthConfig

BASE: dict[str, Any] = {"model": {"uri": "s3://models/llama/v1", "endpoint": "http://s3:9000", "name": "llama"},
                        "runtime": "vllm", "replicas": 3}
OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u"}}
CHAT = {"messages": [{"role": "system", "content": "You answer questions about invoices. " * 10},
                     {"role": "user", "content": "what about tax?"}]}


def render(wire: dict[str, Any]) -> tuple[LlmServerConfig, dict[str, Any], PickerConfig]:
    spec = admitted(InferenceServiceSpec, wire)
    config_map, deployment = render_deployment(
        {**OWNER, "spec": wire}, spec, "stable", resolve_model(spec.model, spec.serving_handler), 1, "server:t",
        vllm_image="vllm:t")
    policy = picker_policy(spec)
    assert policy is not None
    return (LlmServerConfig.model_validate_json(config_map["data"]["llm.json"]),
            deployment["spec"]["template"]["spec"]["containers"][0], picker_config(OWNER, spec, policy))


def test_events_render_the_engine_flag_the_port_and_the_pickers_config() -> None:
    llm, server, picker = render({**BASE, "routing": {"prefixMatch": "events"}})
    assert llm.engine.kv_events_port == 5557
    flag = next(a for a in engine_argv(llm) if a.startswith("--kv-events-config="))
    assert json.loads(flag.split("=", 1)[1]) == {
        # A host instead of * makes vLLM connect to a collector rather than bind: the picker would hear nothing.
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in server["ports"]
    assert picker.kv_events is not None
    assert (picker.kv_events.port, picker.kv_events.topic, picker.kv_events.tokenizer_dir) == (5557, "", None)
    assert PickerConfig.from_json(picker.to_json()) == picker  # what the pod parses back


def test_the_estimate_stays_the_default_and_renders_nothing_new() -> None:
    for routing in ({}, {"prefixMatch": "estimate"}):
        llm, server, picker = render({**BASE, "routing": routing})
        assert llm.engine.kv_events_port is None and "kvEventsPort" not in llm.to_json()
        assert not any(a.startswith("--kv-events-config") for a in engine_argv(llm))
        assert [p["name"] for p in server["ports"]] == ["http"]
        assert picker.kv_events is None


def test_the_api_refuses_events_without_prefix_cache_or_with_the_users_own_flag() -> None:
    with pytest.raises(ValidationError, match="prefixMatch: events needs policy: prefix-cache"):
        admitted(InferenceServiceSpec, {**BASE, "routing": {"prefixMatch": "events", "policy": "least-loaded"}})
    with pytest.raises(ValidationError, match="sets --kv-events-config itself"):
        admitted(InferenceServiceSpec, {**BASE, "routing": {"prefixMatch": "events"},
                                        "vllm": {"extraArgs": ['--kv-events-config={"publisher":"zmq"}']}})
    with pytest.raises(ValidationError, match="prefixMatch"):
        admitted(InferenceServiceSpec, {**BASE, "routing": {"prefixMatch": "exact"}})
    # Without Loom's events, the flag stays the user's to pass.
    admitted(InferenceServiceSpec, {**BASE, "vllm": {"extraArgs": ["--kv-events-config={}"]}})
    with pytest.raises(ValidationError, match="Loom sets it"):
        EngineOptions(kv_events_port=5557, extra_args=["--kv-events-config={}"])


def front(folder: Path, events: bool, chat_template: str | None = None) -> TestClient:
    config = LlmServerConfig(
        model_name="tiny", model_dir=str(folder), auth=AuthConfig(api_keys_env="KEYS_FOR_THIS_TEST"),
        engine=EngineOptions(kv_events_port=5557 if events else None, chat_template=chat_template))
    return TestClient(build_app(config))  # not entered: no lifespan, no engine


def test_the_front_serves_its_tokenizer_without_a_key_only_with_events(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYS_FOR_THIS_TEST", "secret-key")
    write_llama_folder(tmp_path, LlamaShape())
    with_events = front(tmp_path, events=True)
    served = with_events.get("/v2/tokenizer/tokenizer.json")
    assert served.status_code == 200 and served.content == (tmp_path / "tokenizer.json").read_bytes()
    config = with_events.get("/v2/tokenizer/tokenizer_config.json").json()
    assert config == json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert with_events.get("/v2/tokenizer/config.json").status_code == 401  # not a tokenizer file: a key is asked
    assert with_events.get("/v1/models").status_code == 401  # the rest still asks for one
    assert front(tmp_path, events=False).get("/v2/tokenizer/tokenizer.json").status_code == 404  # not served
    # The engine's template when the spec gives one (vllm.chatTemplate), not the model's.
    override = front(tmp_path, events=True, chat_template="{{ messages[0]['content'] }}")
    assert override.get("/v2/tokenizer/tokenizer_config.json").json()["chat_template"] == \
        "{{ messages[0]['content'] }}"


def test_a_model_without_tokenizer_files_is_a_404(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYS_FOR_THIS_TEST", "secret-key")
    assert front(tmp_path, events=True).get("/v2/tokenizer/tokenizer.json").status_code == 404


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def served_front(tmp_path: Path) -> Iterator[str]:
    """A real front over HTTP, its model a tiny Llama folder."""
    write_llama_folder(tmp_path, LlamaShape())
    with serving_front(tmp_path) as address:
        yield address


@contextlib.contextmanager
def serving_front(folder: Path, chat_template: str | None = None) -> Iterator[str]:
    """A real front over HTTP (uvicorn, lifespan off: no engine) on the model in `folder`; yields ip:port."""
    config = LlmServerConfig(model_name="tiny", model_dir=str(folder),
                             engine=EngineOptions(kv_events_port=5557, chat_template=chat_template))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


def test_the_picker_reads_the_tokenizer_from_the_replica_that_answers(served_front: str, tmp_path: Path) -> None:
    unreachable = f"127.0.0.1:{free_port()}"  # sorted first: tried, refused, the next one answers
    replicas = sorted([unreachable, served_front])
    fetched = asyncio.run(asyncio.wait_for(tokenizer_from_replicas(lambda: replicas, 0.05), 30))
    tokenizer = fetched.tokenizer
    assert fetched.digest == httpx.get(f"http://{served_front}/v2/tokenizer").json()["digest"]  # the front's own
    local = PromptTokenizer.from_folder(tmp_path)
    tokens = tokenizer.tokens("/v1/chat/completions", CHAT)
    assert tokens is not None and tokens == local.tokens("/v1/chat/completions", CHAT)
    assert tokenizer.tokens("/v1/completions", {"prompt": "hello"}) == local.tokens("/v1/completions",
                                                                                   {"prompt": "hello"})


def test_a_model_without_tokenizer_json_keeps_the_estimate_and_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose folder has no tokenizer.json (a sentencepiece tokenizer.model only): the front answers 404, the
    picker keeps routing by its estimate and asks again less and less often, warning once, not at every try."""
    waits: list[float] = []

    class Enough(Exception):
        pass

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 4:
            raise Enough

    with (serving_front(tmp_path) as address, caplog.at_level(logging.DEBUG, "loom.workloads.picker"),
          pytest.raises(Enough)):
        asyncio.run(tokenizer_from_replicas(lambda: [address], 0.5, sleep))
    assert waits == [0.5, 1.0, 2.0, 4.0]
    told = [r for r in caplog.records if "no tokenizer from" in r.getMessage()]
    assert [r.levelno for r in told] == [logging.WARNING] + [logging.DEBUG] * 3
    assert "404" in told[0].getMessage()


def test_a_new_tokenizer_is_taken_once_every_replica_serves_it() -> None:
    assert switch_to("old", {"a": "new", "b": "new", "c": None}) == "new"  # c not answering: not counted
    assert switch_to("old", {"a": "old", "b": "new"}) is None  # a rollout under way: old still matches a's engine
    assert switch_to("old", {"a": "old"}) is None and switch_to("old", {"a": None}) is None
    assert switch_to("old", {}) is None


def test_the_picker_follows_the_replicas_to_a_new_models_tokenizer(tmp_path: Path) -> None:
    """The replicas before and after a model change (here the engine's chat template changed, so the served
    tokenizer_config.json and its digest do): the picker keeps its tokenizer while the old replica answers, then
    takes the new replica's."""
    write_llama_folder(tmp_path, LlamaShape())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    with serving_front(tmp_path) as old, serving_front(tmp_path, chat_template=template) as new:
        first = asyncio.run(tokenizer_from_replicas(lambda: [old], 0.05))
        listed = [[old], [old, new], [new]]  # what each check finds: the rollout's steps
        used: list[Any] = []

        class Done(Exception):
            pass

        async def sleep(seconds: float) -> None:
            if not listed:
                raise Done
            replicas[:] = listed.pop(0)

        def use(tokenizer: Any) -> None:
            used.append((len(listed), tokenizer))

        replicas: list[str] = []
        with pytest.raises(Done):
            asyncio.run(follow_tokenizer(use, lambda: replicas, first.digest, 60, sleep))
    assert [steps_left for steps_left, _ in used] == [0]  # taken at the last step only, once
    tokens = used[0][1].tokens("/v1/chat/completions", CHAT)
    assert tokens is not None and tokens != first.tokenizer.tokens("/v1/chat/completions", CHAT)
