"""The front's adapter wiring, in process, over an engine that answers like vLLM's OpenAI server and records what it
was sent (the real engine: tests/integration/test_llm_vllm.py): /v1/models lists the adapters loaded, a request
names an adapter and reaches the engine as that adapter's current version, its answer names the adapter again, and
the adapter states are open to the operator without an API key."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from loom.workloads.llm.adapters import ADAPTERS_PATH, AdapterList, AdapterSource
from loom.workloads.llm.app import build_app
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.server.config import AuthConfig

PIRATE = AdapterSource(name="pirate", uri="s3://a/pirate", kind="s3")
KEY = {"authorization": "Bearer k1"}


class FakeEngine:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.loaded: dict[str, str] = {}
        self.running = True

    async def start(self) -> None: ...
    async def wait_ready(self) -> None: ...
    async def stop(self) -> None: ...
    async def healthy(self) -> bool:
        return True

    async def metrics_text(self) -> str:
        return ""

    async def load_adapter(self, name: str, path: str) -> None:
        self.loaded[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.loaded.pop(name, None)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        self.bodies.append(body)
        if body["model"] != "tiny" and body["model"] not in self.loaded:
            return 404, json.dumps({"error": {"message": "no such model"}}).encode()
        answer = {"model": body["model"], "choices": [{"text": "arr", "index": 0}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        return 200, json.dumps(answer).encode()

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, AsyncIterator[bytes], bytes]]:
        self.bodies.append(body)

        async def data() -> AsyncIterator[bytes]:
            yield b"data: " + json.dumps({"model": body["model"], "choices": [{"text": "a", "index": 0}]}).encode()
            yield b"\n\ndata: " + json.dumps({"model": body["model"], "choices": [],
                                              "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
            yield b"\n\ndata: [DONE]\n\n"

        yield 200, data(), b""


def fetched(source: AdapterSource, root: Path) -> Path:
    return root


@pytest.fixture
def front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, FakeEngine, Path]:
    monkeypatch.setattr("loom.workloads.llm.adapter_manager.fetch_adapter", fetched)
    monkeypatch.setenv("LOOM_TEST_KEYS", "k1")
    listing = tmp_path / "adapters.json"
    listing.write_text(AdapterList(adapters=[PIRATE]).to_json())
    config = LlmServerConfig(model_name="tiny", model_dir=str(tmp_path), engine=EngineOptions(enable_lora=True),
                             adapters_file=str(listing), adapters_dir=str(tmp_path / "cache"), adapters_poll_s=0.05,
                             auth=AuthConfig(api_keys_env="LOOM_TEST_KEYS"))
    engine = FakeEngine()
    return TestClient(build_app(config, engine=engine)), engine, listing  # type: ignore[arg-type]


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.02)


def test_a_request_names_an_adapter_and_reaches_its_version(front: tuple[TestClient, FakeEngine, Path]) -> None:
    client, engine, listing = front
    with client:
        wait_ready(client)  # the adapters listed at start are loaded before the replica is ready
        models = client.get("/v1/models", headers=KEY).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("pirate", "tiny")]
        answer = client.post("/v1/completions", headers=KEY, json={"model": "pirate", "prompt": "Tom"})
        assert answer.status_code == 200 and answer.json()["model"] == "pirate"
        assert engine.bodies[-1]["model"] == PIRATE.engine_name
        streamed = client.post("/v1/completions", headers=KEY,
                               json={"model": "pirate", "prompt": "Tom", "stream": True})
        events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
        assert events and {e["model"] for e in events} == {"pirate"}
        assert client.post("/v1/completions", headers=KEY, json={"model": "tiny", "prompt": "Tom"}).json()["model"] \
            == "tiny"
        # The operator reads the states with no key; a model endpoint still wants one.
        states = client.get(ADAPTERS_PATH).json()["adapters"]
        assert states == [{"name": "pirate", "key": PIRATE.key, "state": "Loaded"}]
        assert client.get("/v1/models").status_code == 401

        listing.write_text(AdapterList().to_json())
        deadline = time.monotonic() + 10
        while engine.loaded:
            assert time.monotonic() < deadline, "the removed adapter was never unloaded"
            time.sleep(0.02)
        gone = client.post("/v1/completions", headers=KEY, json={"model": "pirate", "prompt": "Tom"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in client.get("/v1/models", headers=KEY).json()["data"]] == ["tiny"]
