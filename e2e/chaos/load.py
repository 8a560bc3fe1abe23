"""An open-loop request load for the serving scenarios: requests start at a fixed rate whatever the answers do (a
slow or hung response never lowers the offered rate, as it would with a few closed-loop workers), bounded in count
and in time, and every request's start, latency, outcome and phase (a label the scenario moves along) is recorded.

It runs its own asyncio loop (httpx.AsyncClient) in a thread, so a synchronous scenario drives the stack meanwhile.
Only addresses on this machine are meant: the Service addresses the node agent proxies.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from .registry import percentile


@dataclass(frozen=True)
class Outcome:
    started: float  # time.monotonic() when the request was due
    latency_ms: float
    phase: str
    version: str | None  # the model_version that answered; None when the request failed
    error: str | None


def infer_body() -> dict[str, Any]:
    return {"id": uuid.uuid4().hex, "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


@dataclass
class OpenLoopLoad:
    """POST /v2/models/<model>/infer at `rps` until stopped, `max_s` elapsed or `max_requests` sent."""

    url: str
    model: str
    rps: float
    max_s: float
    keep_alive: bool = True
    # Idle kept-alive connections are dropped by the client after this long: well inside the model server's drain
    # window (6 s), so the server never closes an idle connection under a request (that race loses the request).
    keepalive_expiry_s: float = 2.0
    timeout_s: float = 15.0
    phase: str = "before"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _first: float = 0.0
    _last: float = 0.0

    @property
    def max_requests(self) -> int:
        return int(self.rps * self.max_s)

    async def _one(self, http: httpx.AsyncClient, due: float, phase: str) -> None:
        version = error = None
        try:
            response = await http.post(f"{self.url}/v2/models/{self.model}/infer", json=infer_body())
            if response.status_code == 200:
                version = response.json().get("model_version") or "?"
            else:
                error = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        outcome = Outcome(due, (time.monotonic() - due) * 1000, phase, version, error)
        with self._lock:
            self.outcomes.append(outcome)

    async def _main(self) -> None:
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=None if self.keep_alive else 0,
            keepalive_expiry=self.keepalive_expiry_s,
        )
        async with httpx.AsyncClient(trust_env=False, timeout=self.timeout_s, limits=limits) as http:
            tasks: set[asyncio.Task[None]] = set()
            start = time.monotonic()
            self._first = start
            for i in range(self.max_requests):
                due = start + i / self.rps
                if self._stop.is_set() or due - start > self.max_s:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                task = asyncio.create_task(self._one(http, due, self.phase))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            self._last = time.monotonic()
            if tasks:
                await asyncio.gather(*tasks)

    def __enter__(self) -> OpenLoopLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="open-loop-load")
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 15)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def served(self) -> int:
        return sum(1 for o in self.snapshot() if o.error is None)

    def figures(self) -> dict[str, Any]:
        """Counts, the rate achieved (requests started per second), failures and per-phase latencies."""
        outcomes = self.snapshot()
        failed = [o for o in outcomes if o.error is not None]
        span = max(self._last - self._first, 1e-9)
        figures: dict[str, Any] = {
            "requests": len(outcomes),
            "rps_offered": self.rps,
            "rps_achieved": round(len(outcomes) / span, 1),
            "failed_requests": len(failed),
            "versions": dict(Counter(o.version for o in outcomes if o.version)),
        }
        for phase in dict.fromkeys(o.phase for o in outcomes):
            figures[f"latency_{phase}_ms"] = [o.latency_ms for o in outcomes if o.phase == phase and not o.error]
        figures["failure_examples"] = sorted({f"{o.phase}: {o.error}"[:200] for o in failed})[:5]
        return figures


def p50_p99(values: list[float]) -> str:
    return f"p50={percentile(values, 50):.1f} ms p99={percentile(values, 99):.1f} ms"
