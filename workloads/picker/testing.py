"""Run the endpoint picker for real (its pod's command, over fixed replicas) in tests and benchmarks."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loom.workloads.server.testing import running

from .config import PickerConfig
from .state import PickerState


@contextlib.contextmanager
def picker_process(config: PickerConfig, endpoints: Sequence[str], folder: Path,
                   kv_events: Sequence[str] = (), roles: Sequence[str] = ()) -> Iterator[str]:
    """``python -m loom.workloads.picker --endpoints ...`` on ``config`` (its log: ``folder/picker-<port>.log``);
    yields its URL once a replica answers its readiness through it. `kv_events`: each replica's KV-event
    publisher (tcp://host:port), in the order of `endpoints`; `roles`: each replica's `role[:kv-version]`
    (disaggregation), in the same order."""
    path = folder / f"picker-{config.port}.json"
    path.write_text(config.to_json())
    argv = [sys.executable, "-m", "loom.workloads.picker", "--config", str(path), "--endpoints", ",".join(endpoints)]
    if kv_events:
        argv += ["--kv-events", ",".join(kv_events)]
    if roles:
        argv += ["--roles", ",".join(roles)]
    with running(argv, f"http://{config.host}:{config.port}", folder / f"picker-{config.port}.log") as url:
        yield url


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls))


def route_chat(state: PickerState, model: str, *messages: tuple[str, str]) -> str:
    """One chat completion through the picker's decision alone (pick, sent, done: no engine): the endpoint it chose.
    `messages`: (role, content) pairs."""
    body = {"model": model, "messages": [{"role": role, "content": content} for role, content in messages]}
    pick = state.pick("/v1/chat/completions", json.dumps(body).encode(), {})
    assert pick is not None
    state.sent(pick)
    state.done(pick.decision.endpoint)
    return pick.decision.endpoint
