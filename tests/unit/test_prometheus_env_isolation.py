"""conftest.py keeps PROMETHEUS_MULTIPROC_DIR (set by importing Feast, at collection) out of session- and
module-scoped fixtures too: the processes they start (the MLflow server, vLLM engines) must keep their own metrics.
CI's MLflow server, a session fixture, once inherited it and failed to start."""

from __future__ import annotations

import os

import pytest

os.environ["PROMETHEUS_MULTIPROC_DIR"] = "/nonexistent/loom-test-multiproc"  # what importing Feast does


@pytest.fixture(scope="session")
def environment_at_session_setup() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


@pytest.fixture(scope="module")
def environment_at_module_setup() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def test_session_and_module_fixtures_start_without_the_multiprocess_directory(
    environment_at_session_setup: str | None, environment_at_module_setup: str | None
) -> None:
    assert environment_at_session_setup is None and environment_at_module_setup is None
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
