"""LoRA adapters of the vllm runtime: the list the operator hands the pod, and what the front does about it (pure).

The operator writes ``adapters.json`` (an ``AdapterList``) into the pod's ConfigMap, beside ``llm.json`` but outside
the pod template's config hash, so a changed list reaches the running pod (the kubelet rewrites ConfigMap volumes in
place) instead of rolling the Deployment. The front reads it again whenever it changes and turns the difference
between that list and what the engine holds into loads and unloads (``plan_adapters``, here, pure).

Each adapter version has its own name inside the engine, ``<name>@<key>`` (``engine_name``): a new version is
loaded beside the old one, requests switch to it once it is loaded, and the old one is unloaded when no request
uses it any more, so no request in flight ever finds its adapter gone. Imports pydantic only (the operator renders
these models).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from loom.workloads.common.config import CamelModel, WorkloadConfig
from loom.workloads.common.model_name import MODEL_NAME_RULE, model_name

AdapterKind = Literal["s3", "mlflow"]
AdapterState = Literal["Pending", "Loading", "Loaded", "Failed"]
ADAPTERS_FILE = "adapters.json"
AdapterName = Annotated[str, model_name("adapter name")]
# Where the front reports its adapters' states (open like the probes: names and states, no data).
ADAPTERS_PATH = "/v2/adapters"


class AdapterSource(CamelModel):
    """One adapter as the pod sees it: a name requests select it by, and where its peft files are."""

    name: AdapterName = Field(description=f"The adapter's model name (OpenAI 'model'); {MODEL_NAME_RULE}.")
    uri: str = Field(description="s3://bucket/prefix of a peft adapter folder, or models:/name/version|@alias.")
    kind: AdapterKind
    version: str | None = Field(None, description="A version label: a new one loads the adapter again.")
    tracking_uri: str | None = Field(None, description="MLflow tracking URL (kind mlflow).")

    @property
    def key(self) -> str:
        """What identifies this version of the adapter: its source and version label."""
        ident = json.dumps([self.uri, self.kind, self.version, self.tracking_uri])
        return hashlib.sha256(ident.encode()).hexdigest()[:10]

    @property
    def engine_name(self) -> str:
        return engine_name(self.name, self.key)


def engine_name(name: str, key: str) -> str:
    return f"{name}@{key}"


class AdapterList(WorkloadConfig):
    json_exclude_none: ClassVar[bool] = True

    adapters: list[AdapterSource] = Field(default_factory=list)

    @field_validator("adapters")
    @classmethod
    def _unique(cls, value: list[AdapterSource]) -> list[AdapterSource]:
        names = [a.name for a in value]
        if len(names) != len(set(names)):
            raise ValueError(f"adapter names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
        return value


@dataclass(frozen=True)
class Held:
    """One adapter version the front knows of (loaded into the engine, or on its way, or failed)."""

    source: AdapterSource
    state: AdapterState
    in_use: int = 0  # requests that hold this version now


@dataclass(frozen=True)
class AdapterPlan:
    load: tuple[AdapterSource, ...]  # versions to fetch and load
    unload: tuple[str, ...]  # engine names to unload now (nothing uses them, nothing needs them)
    forget: tuple[str, ...]  # engine names of failed versions no longer asked for (nothing to unload)


def plan_adapters(desired: list[AdapterSource], held: dict[str, Held]) -> AdapterPlan:
    """What to do so the engine holds the desired versions (``held`` by engine name).

    A version no longer desired stays while its name is still desired and the desired version is not loaded yet
    (it keeps answering that name), and while a request uses it; then it is unloaded. A failed version is not
    tried again until its source or version changes (a new key) or it leaves the list and comes back."""
    wanted = {a.engine_name: a for a in desired}
    load = tuple(a for key, a in wanted.items() if key not in held)
    desired_state = {a.name: held[a.engine_name].state if a.engine_name in held else "Pending" for a in desired}
    unload: list[str] = []
    forget: list[str] = []
    for key, version in held.items():
        if key in wanted:
            continue
        if version.state == "Failed":
            forget.append(key)
            continue
        if version.state != "Loaded" or version.in_use:
            continue  # a load in progress finishes first; a version in use drains first
        if desired_state.get(version.source.name) in ("Pending", "Loading"):
            continue  # still answers its name until the new version is loaded
        unload.append(key)
    return AdapterPlan(load, tuple(unload), tuple(forget))


def serving_version(name: str, desired: list[AdapterSource], held: dict[str, Held]) -> str | None:
    """The engine name a request for adapter ``name`` goes to: the desired version once loaded, else an older
    loaded version of the same name still held (replacement in progress); None when there is none."""
    want = next((a for a in desired if a.name == name), None)
    if want is None:
        return None
    current = held.get(want.engine_name)
    if current is not None and current.state == "Loaded":
        return want.engine_name
    older = [k for k, v in held.items() if v.source.name == name and v.state == "Loaded"]
    return older[-1] if older else None


def adapter_folder(downloaded: Path) -> Path:
    """The folder inside a download that holds the peft adapter (its adapter_config.json): the download itself or
    the one folder below it that has one (an MLflow model's artifacts nest it)."""
    if (downloaded / "adapter_config.json").is_file():
        return downloaded
    found = sorted(p.parent for p in downloaded.rglob("adapter_config.json"))
    if len(found) != 1:
        what = "no adapter_config.json" if not found else f"{len(found)} adapter_config.json files"
        raise ValueError(f"{what} in the adapter's files: it is not one peft adapter")
    return found[0]
