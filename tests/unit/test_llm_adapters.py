"""The front's adapters: the adapter-list diff (pure), and the loop that carries it out against an engine that
records what it is told (the real engine's part is tests/integration/test_llm_vllm.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from loom.workloads.llm.adapter_manager import AdapterManager
from loom.workloads.llm.adapters import (
    AdapterList,
    AdapterSource,
    Held,
    adapter_folder,
    plan_adapters,
    serving_version,
)
from loom.workloads.llm.config import EngineOptions, LlmServerConfig
from loom.workloads.llm.engine import AdapterLoadError
from loom.workloads.llm.openai_protocol import OpenAIError

A1 = AdapterSource(name="pirate", uri="s3://a/pirate", kind="s3", version="1")
A2 = AdapterSource(name="pirate", uri="s3://a/pirate", kind="s3", version="2")
B = AdapterSource(name="poet", uri="models:/poet/3", kind="mlflow", tracking_uri="http://mlflow")


def held(*items: tuple[AdapterSource, str, int]) -> dict[str, Held]:
    return {s.engine_name: Held(s, state, in_use) for s, state, in_use in items}  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- the diff


def test_new_adapters_are_loaded_and_removed_ones_unloaded() -> None:
    plan = plan_adapters([A1, B], {})
    assert plan.load == (A1, B) and plan.unload == () and plan.forget == ()
    plan = plan_adapters([B], held((A1, "Loaded", 0), (B, "Loaded", 0)))
    assert plan.load == () and plan.unload == (A1.engine_name,)
    assert plan_adapters([A1, B], held((A1, "Loaded", 0), (B, "Loaded", 0))) == plan_adapters([], {})


def test_a_new_version_loads_beside_the_old_which_serves_until_it_is_loaded() -> None:
    assert A1.engine_name != A2.engine_name and A1.engine_name.startswith("pirate@")
    loading = held((A1, "Loaded", 0), (A2, "Loading", 0))
    assert plan_adapters([A2], loading).unload == ()
    assert serving_version("pirate", [A2], loading) == A1.engine_name  # the old one still answers
    loaded = held((A1, "Loaded", 0), (A2, "Loaded", 0))
    assert plan_adapters([A2], loaded).unload == (A1.engine_name,)
    assert serving_version("pirate", [A2], loaded) == A2.engine_name
    # A request still on the old version keeps it until it ends.
    assert plan_adapters([A2], held((A1, "Loaded", 1), (A2, "Loaded", 0))).unload == ()


def test_a_removed_adapter_in_use_drains_first_and_a_failed_one_is_forgotten() -> None:
    assert plan_adapters([], held((A1, "Loaded", 2))).unload == ()
    assert plan_adapters([], held((A1, "Loaded", 0))).unload == (A1.engine_name,)
    assert plan_adapters([], held((A1, "Failed", 0))).forget == (A1.engine_name,)
    # A failed version is not tried again while it is still asked for; a new version is.
    assert plan_adapters([A1], held((A1, "Failed", 0))).load == ()
    assert plan_adapters([A2], held((A1, "Failed", 0))).load == (A2,)
    assert serving_version("pirate", [A1], held((A1, "Failed", 0))) is None
    assert serving_version("other", [A1], held((A1, "Loaded", 0))) is None


def test_the_list_refuses_duplicate_and_bad_names() -> None:
    with pytest.raises(ValidationError, match="unique"):
        AdapterList(adapters=[A1, A2])
    with pytest.raises(ValidationError, match="adapter name"):
        AdapterSource(name="no spaces", uri="s3://a/b", kind="s3")
    assert AdapterList.model_validate_json(AdapterList(adapters=[A1, B]).to_json()).adapters == [A1, B]


def test_the_adapter_folder_is_found_where_mlflow_nests_it(tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "adapter_config.json").write_text("{}")
    assert adapter_folder(tmp_path / "flat") == tmp_path / "flat"
    (tmp_path / "nested" / "artifacts" / "adapter").mkdir(parents=True)
    (tmp_path / "nested" / "artifacts" / "adapter" / "adapter_config.json").write_text("{}")
    assert adapter_folder(tmp_path / "nested") == tmp_path / "nested" / "artifacts" / "adapter"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        adapter_folder(tmp_path / "empty")


# ------------------------------------------------------------------------------------------- the loop


class RecordingEngine:
    """Stands in for VllmEngine's two adapter calls; refuses the adapter named junk."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    async def load_adapter(self, name: str, path: str) -> None:
        self.calls.append(("load", name))
        if name.startswith("junk@"):
            raise AdapterLoadError("the engine answered 400: not a LoRA adapter")
        self.loaded[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.loaded.pop(name, None)


def fake_fetch(source: AdapterSource, root: Path) -> Path:
    if "missing" in source.uri:
        raise FileNotFoundError(f"nothing found at {source.uri}")
    folder = root / source.engine_name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def manager(tmp_path: Path) -> tuple[AdapterManager, Path, RecordingEngine]:
    listing = tmp_path / "adapters.json"
    listing.write_text(AdapterList().to_json())
    config = LlmServerConfig(model_name="base", model_dir=str(tmp_path), engine=EngineOptions(enable_lora=True),
                             adapters_file=str(listing), adapters_dir=str(tmp_path / "cache"))
    engine = RecordingEngine()
    return AdapterManager(config, engine, fetch=fake_fetch), listing, engine  # type: ignore[arg-type]


async def converge(m: AdapterManager) -> None:
    for _ in range(5):
        m.read_list()
        m.step()
        await m.settled()
        await asyncio.sleep(0)


def test_the_loop_loads_replaces_and_unloads_as_the_file_changes(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, listing, engine = manager(tmp_path)
        listing.write_text(AdapterList(adapters=[A1, B]).to_json())
        await converge(m)
        assert set(engine.loaded) == {A1.engine_name, B.engine_name} and m.loaded() == ["pirate", "poet"]
        # A request holds version 1 while version 2 arrives: 1 stays until the request ends.
        key = m.acquire("pirate")
        assert key == A1.engine_name
        listing.write_text(AdapterList(adapters=[A2, B]).to_json())
        await converge(m)
        assert set(engine.loaded) == {A1.engine_name, A2.engine_name, B.engine_name}
        assert m.acquire("pirate") == A2.engine_name  # new requests get the new version
        m.release(A2.engine_name)
        m.release(key)
        await converge(m)
        assert set(engine.loaded) == {A2.engine_name, B.engine_name}
        listing.write_text(AdapterList(adapters=[B]).to_json())
        await converge(m)
        assert set(engine.loaded) == {B.engine_name} and m.loaded() == ["poet"]
        assert not (tmp_path / "cache" / A2.engine_name).exists()  # its files go with it

    asyncio.run(scenario())


def test_a_broken_adapter_fails_alone_with_its_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, listing, engine = manager(tmp_path)
        missing = AdapterSource(name="ghost", uri="s3://a/missing", kind="s3")
        broken = AdapterSource(name="junk", uri="s3://a/broken", kind="s3")
        listing.write_text(AdapterList(adapters=[A1, missing, broken]).to_json())
        await converge(m)
        report = {a["name"]: a for a in m.report()["adapters"]}
        assert report["pirate"]["state"] == "Loaded"
        assert report["ghost"]["state"] == "Failed" and "nothing found at s3://a/missing" in report["ghost"]["reason"]
        assert report["junk"]["state"] == "Failed" and "not a LoRA adapter" in report["junk"]["reason"]
        assert m.loaded() == ["pirate"]
        with pytest.raises(OpenAIError) as caught:
            m.acquire("junk")
        assert caught.value.status == 503 and caught.value.code == "adapter_failed"
        # Not tried again for nothing: the same failed version stays failed.
        calls = len(engine.calls)
        await converge(m)
        assert len(engine.calls) == calls
        # An unreadable list keeps what is loaded, and says why.
        listing.write_text("{not json")
        await converge(m)
        assert m.loaded() == ["pirate"] and "not valid" in m.report()["listError"]

    asyncio.run(scenario())


def test_a_request_for_an_adapter_still_loading_is_told_to_retry(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, listing, _ = manager(tmp_path)
        listing.write_text(AdapterList(adapters=[A1]).to_json())
        m.read_list()
        m.step()  # started, not finished
        with pytest.raises(OpenAIError) as caught:
            m.acquire("pirate")
        assert caught.value.status == 503 and caught.value.code == "adapter_loading"
        assert caught.value.headers == {"retry-after": "2"}
        await m.settled()
        assert m.acquire("pirate") == A1.engine_name

    asyncio.run(scenario())
