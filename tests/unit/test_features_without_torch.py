"""The feature commands run without importing torch, which Feast would import at its own import whenever torch is
installed (as it is in this project's environment, which the local stack's pods run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # Feast's own import: seconds

PROBE = """
import sys
from loom.workloads.features.__main__ import import_commands
commands = import_commands()
import feast.torch_wrapper
assert sys.modules.get("torch") is None, "torch was imported"
assert feast.torch_wrapper.TORCH_AVAILABLE is False
assert callable(commands.open_store) and callable(commands.serve)
print("ok")
"""


def test_the_feature_commands_import_feast_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True,
        timeout=300, check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
