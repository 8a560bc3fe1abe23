"""Keeps one test's imports from changing how every later test's Prometheus metrics behave.

Importing Feast (feast/metrics.py) sets PROMETHEUS_MULTIPROC_DIR for the whole process. prometheus_client
picks its value class once, at its own first import: imported after Feast, every metric of every later test
(the model server's, the router's) shares its values through files across registries, and counts leak from
one test into another. Importing prometheus_client first, before any test module, keeps the in-process
value class; the hooks below keep the variable out of every fixture's and every test's environment (subprocesses
included), whatever the fixture's scope: collection imports Feast before any fixture runs (CI's session-scoped
MLflow server was once started with a multiprocess directory and failed on it), and the two vLLM replicas of
test_picker_vllm, module-scoped, started with it after the Feast tests had run, shared one multiprocess directory
with every earlier process, so both engines reported the same counters ([1024, 1024] prefix-cache hits).
The Feast pods themselves are untouched: `feast serve` runs in its own process and sets what it needs.
"""

from __future__ import annotations

import os

import prometheus_client  # noqa: F401  (fixes the value class before any test module can import Feast)
import pytest

_MULTIPROCESS_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


class _NoMultiprocessDirectory:
    """Hooks of a registered plugin, not of this conftest: a conftest's hooks reach only the nodes below its
    folder, and a session-scoped fixture is set up on the session node, above it."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_fixture_setup(self) -> None:
        """Before every fixture of any scope: the processes fixtures start never inherit the variable."""
        _clear()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self) -> None:
        """And before every test body, for a module that imported Feast during an earlier test."""
        _clear()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_NoMultiprocessDirectory(), "loom-no-prometheus-multiprocess-directory")


def _clear() -> None:
    for name in _MULTIPROCESS_VARIABLES:
        os.environ.pop(name, None)
