"""DeepSpeed is imported without MLflow (its unused autotuner would import it on every rank), and MLflow still
imports afterwards for a rank that tracks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # DeepSpeed's own import: seconds

PROBE = """
import sys
from loom.workloads.trainer.engines import import_deepspeed
deepspeed = import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
assert "mlflow" not in sys.modules, "mlflow was imported"
assert autotuner.has_mlflow is False
assert callable(deepspeed.initialize)
from mlflow.tracking import MlflowClient  # a tracking rank, afterwards
assert import_deepspeed() is deepspeed
print("ok")
"""


def test_deepspeed_imports_without_mlflow_and_mlflow_still_imports_after() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.splitlines()[-1:] == ["ok"], result.stderr[-3000:]
