"""Which model-server pods can take a request now (pure selection plus a small async state holder)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping
from typing import Any


def _ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def ready_endpoints(pods: Iterable[Mapping[str, Any]], port: int) -> tuple[str, ...]:
    """`ip:port` of every pod that is Ready, has an IP and is not terminating (a terminating replica drains
    what it has; it takes nothing new), sorted so the order is stable."""
    endpoints = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if ip and not meta.get("deletionTimestamp") and _ready(pod):
            host = f"[{ip}]" if ":" in ip else ip
            endpoints.add(f"{host}:{port}")
    return tuple(sorted(endpoints))


class Targets:
    """The Ready endpoints as last seen; waiters wake when the first one appears. Updated from one thread-safe
    entry point (`publish`, via the loop) by whatever watches the pods."""

    def __init__(self) -> None:
        self._endpoints: tuple[str, ...] = ()
        self._available = asyncio.Event()
        self._turn = itertools.count()

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints

    def set(self, endpoints: Iterable[str]) -> None:
        self._endpoints = tuple(endpoints)
        if self._endpoints:
            self._available.set()
        else:
            self._available.clear()

    def forget(self, endpoint: str) -> None:
        """An endpoint that refused a connection: not tried again until the pod watch lists it again."""
        self.set(e for e in self._endpoints if e != endpoint)

    def pick(self) -> str | None:
        """Round robin over the Ready endpoints, or None when there is none."""
        if not self._endpoints:
            return None
        return self._endpoints[next(self._turn) % len(self._endpoints)]

    async def wait(self, timeout: float) -> bool:
        """Until an endpoint is Ready (True) or `timeout` seconds passed (False)."""
        if self._endpoints:
            return True
        try:
            await asyncio.wait_for(self._available.wait(), timeout=max(0.0, timeout))
        except TimeoutError:
            return bool(self._endpoints)
        return True
