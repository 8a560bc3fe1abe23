"""conftest.py keeps PROMETHEUS_MULTIPROC_DIR (set by importing Feast, at collection) out of module-scoped
fixtures too: the processes they start (vLLM engines, servers) must keep their own metrics."""

from __future__ import annotations

import os

import pytest

os.environ["PROMETHEUS_MULTIPROC_DIR"] = "/nonexistent/loom-test-multiproc"  # what importing Feast does


@pytest.fixture(scope="module")
def environment_at_module_setup() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def test_a_module_fixture_starts_without_the_multiprocess_directory(environment_at_module_setup: str | None) -> None:
    assert environment_at_module_setup is None
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
