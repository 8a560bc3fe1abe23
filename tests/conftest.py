"""Keeps one test's imports from changing how every later test's Prometheus metrics behave.

Importing Feast (feast/metrics.py) sets PROMETHEUS_MULTIPROC_DIR for the whole process. prometheus_client
picks its value class once, at its own first import: imported after Feast, every metric of every later test
(the model server's, the router's) shares its values through files across registries, and counts leak from
one test into another. Importing prometheus_client first, before any test module, keeps the in-process
value class; the fixtures keep the variable out of every test's environment (subprocesses included), at each
scope, as a fixture of a wider scope runs before those of narrower ones: the session-scoped one for the servers
started once per session (collection imports Feast before any fixture runs: CI's MLflow server was started with a
multiprocess directory and failed on it), the module-scoped one for module fixtures (the two vLLM replicas of
test_picker_vllm, started with it after the Feast tests had run, shared one multiprocess directory with every
earlier process, so both engines reported the same counters ([1024, 1024] prefix-cache hits) and their /metrics
took seconds to read), the function-scoped one for a test that imports Feast itself.
The Feast pods themselves are untouched: `feast serve` runs in its own process and sets what it needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import prometheus_client  # noqa: F401  (fixes the value class before any test module can import Feast)
import pytest

_MULTIPROCESS_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def _cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _MULTIPROCESS_VARIABLES:
        if name in os.environ:
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True, scope="session")
def _no_prometheus_multiprocess_mode_in_session_fixtures() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        _cleared(monkeypatch)
        yield


@pytest.fixture(autouse=True, scope="module")
def _no_prometheus_multiprocess_mode_in_module_fixtures() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        _cleared(monkeypatch)
        yield


@pytest.fixture(autouse=True)
def _no_prometheus_multiprocess_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    _cleared(monkeypatch)
    yield
