"""Fixtures for the trainer tests: a fresh bucket per test and a torchrun launcher."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loom.devstack.servers import S3Endpoint
from loom.e2e.trainer_harness import TrainerRun, torchrun_argv, trainer_env


@pytest.fixture
def bucket(s3: S3Endpoint) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def run_trainer(s3: S3Endpoint, tmp_path: Path) -> Callable[..., TrainerRun]:
    counter = iter(range(1000))

    def run(config: dict[str, Any], nproc: int = 2, timeout: float = 600,
            env: dict[str, str] | None = None) -> TrainerRun:
        path = tmp_path / f"config-{next(counter)}.json"
        path.write_text(json.dumps(config))
        completed = subprocess.run(
            torchrun_argv(path, nproc), env={**trainer_env(s3), **(env or {})}, capture_output=True, text=True,
            timeout=timeout,
        )
        result = TrainerRun(completed.returncode, completed.stdout + completed.stderr)
        assert result.returncode == 0, result.output[-6000:]
        return result

    return run
