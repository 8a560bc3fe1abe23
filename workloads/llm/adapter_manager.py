"""The front's adapter loop: follows the adapter list's file and makes the engine hold what it names.

Every ``adaptersPollS`` the file is read; a changed list is planned against what the engine holds
(adapters.plan_adapters, pure) and carried out: each new version is fetched (in a thread) and loaded through
vLLM's runtime LoRA API, each one no longer needed unloaded once no request uses it. One adapter failing (its files
missing, not a peft adapter, refused by the engine) marks only that adapter Failed, with the reason; the others and
the base model keep serving. Requests take a version with ``acquire`` and give it back with ``release``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .adapter_fetch import fetch_adapter, remove_adapter
from .adapters import AdapterList, AdapterSource, Held, plan_adapters, serving_version
from .config import LlmServerConfig
from .engine import VllmEngine
from .openai_protocol import OpenAIError

log = logging.getLogger(__name__)
Fetch = Callable[[AdapterSource, Path], Path]
REASON_LIMIT = 500
DEFAULT_POLL_S = 1.0


class AdapterManager:
    def __init__(self, config: LlmServerConfig, engine: VllmEngine, fetch: Fetch | None = None) -> None:
        self.file = Path(config.adapters_file) if config.adapters_file else None
        self.root = Path(config.adapters_dir) if config.adapters_dir else Path(tempfile.mkdtemp(prefix="adapters-"))
        self.poll_s = config.adapters_poll_s or DEFAULT_POLL_S
        self.engine, self.fetch = engine, fetch or fetch_adapter
        self.desired: list[AdapterSource] = []
        self.held: dict[str, Held] = {}
        self.reasons: dict[str, str] = {}
        self.list_error: str | None = None
        self._text: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._kick = asyncio.Event()

    @property
    def names(self) -> set[str]:
        return {a.name for a in self.desired}

    # ------------------------------------------------------------------------------------------- the loop
    def read_list(self) -> bool:
        """Read the file; True when the list changed. An unreadable list keeps the previous one (and says why)."""
        if self.file is None:
            return False
        try:
            text = self.file.read_text()
        except OSError as exc:
            self.list_error = f"cannot read {self.file}: {exc.strerror or exc}"
            return False
        if text == self._text:
            return False
        self._text = text
        try:
            adapters = AdapterList.from_json(text).adapters
        except ValueError as exc:  # not JSON (json.JSONDecodeError) or not an adapter list (ValidationError)
            why = exc.errors()[0].get("msg") if isinstance(exc, ValidationError) else str(exc)
            self.list_error = f"the adapter list is not valid: {why}"
            return False
        self.list_error = None
        changed = adapters != self.desired
        self.desired = adapters
        return changed

    def step(self) -> None:
        """Plan against what is held and start the work (loads and unloads run as tasks)."""
        plan = plan_adapters(self.desired, self.held)
        for key in plan.forget:
            self.held.pop(key, None)
            self.reasons.pop(key, None)
        for source in plan.load:
            self.held[source.engine_name] = Held(source, "Loading")
            self._spawn(self._load(source))
        for key in plan.unload:
            # Gone from `held` at once: no new request can take it while it is being unloaded.
            version = self.held.pop(key)
            self._spawn(self._unload(version.source))

    async def run(self) -> None:
        """Until cancelled (the app's lifespan ends): follow the file, plan, carry out."""
        while True:
            self.read_list()
            self.step()
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.poll_s)

    async def settled(self) -> None:
        """Until the work started is done: no adapter loading (each ends Loaded or Failed), no unload running."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, source: AdapterSource) -> None:
        key = source.engine_name
        try:
            folder = await asyncio.to_thread(self.fetch, source, self.root)
            await self.engine.load_adapter(key, str(folder))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one adapter's failure is its own: recorded, the rest goes on
            reason = f"{type(exc).__name__}: {exc}"[:REASON_LIMIT]
            log.warning("adapter %s (%s) failed to load: %s", source.name, source.uri, reason)
            if key in self.held:
                self.held[key] = replace(self.held[key], state="Failed")
                self.reasons[key] = reason
            self._kick.set()
            return
        log.info("adapter %s loaded from %s (as %s)", source.name, source.uri, key)
        if key in self.held:
            self.held[key] = replace(self.held[key], state="Loaded")
        self._kick.set()  # an older version of the same name may now go

    async def _unload(self, source: AdapterSource) -> None:
        try:
            await self.engine.unload_adapter(source.engine_name)
        except Exception as exc:  # vLLM forgets the name in any case at a restart; files go anyway
            log.warning("unloading adapter %s failed: %s", source.engine_name, exc)
        await asyncio.to_thread(remove_adapter, source, self.root)
        log.info("adapter %s (%s) unloaded", source.name, source.engine_name)

    # ------------------------------------------------------------------------------------------- requests
    def acquire(self, name: str) -> str:
        """The engine name a request for adapter ``name`` uses, held until ``release``; an OpenAI error when the
        adapter cannot answer now."""
        key = serving_version(name, self.desired, self.held)
        if key is None:
            want = next(a for a in self.desired if a.name == name)
            version = self.held.get(want.engine_name)
            if version is not None and version.state == "Failed":
                reason = self.reasons.get(want.engine_name, "unknown")
                raise OpenAIError(503, f"the adapter '{name}' failed to load: {reason}", "adapter_failed", "model")
            raise OpenAIError(503, f"the adapter '{name}' is still loading", "adapter_loading", "model",
                              headers={"retry-after": "2"})
        self.held[key] = replace(self.held[key], in_use=self.held[key].in_use + 1)
        return key

    def release(self, key: str) -> None:
        version = self.held.get(key)
        if version is not None:
            self.held[key] = replace(version, in_use=max(0, version.in_use - 1))
            if version.in_use <= 1:
                self._kick.set()

    def public_name(self, key: str) -> str:
        version = self.held.get(key)
        return version.source.name if version is not None else key.split("@", 1)[0]

    def loaded(self) -> list[str]:
        """Names of the adapters that answer now."""
        return [a.name for a in self.desired if serving_version(a.name, self.desired, self.held) is not None]

    def report(self) -> dict[str, Any]:
        """Every desired adapter's state on this replica (what the operator reads into status)."""
        adapters = []
        for source in self.desired:
            version = self.held.get(source.engine_name)
            entry: dict[str, Any] = {"name": source.name, "key": source.key,
                                     "state": version.state if version else "Pending"}
            if source.version:
                entry["version"] = source.version
            if version is not None and version.state == "Failed":
                entry["reason"] = self.reasons.get(source.engine_name, "")
            adapters.append(entry)
        doc: dict[str, Any] = {"adapters": adapters}
        if self.list_error:
            doc["listError"] = self.list_error
        return doc
