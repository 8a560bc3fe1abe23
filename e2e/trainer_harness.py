"""Run the real trainer launcher under torchrun and read its structured events (tests, e2e, bench)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.devstack.servers import S3Endpoint

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# Small enough that a step takes milliseconds on one CPU core, big enough that the loss visibly falls.
TINY_MODEL = {"nLayer": 2, "nEmbd": 64, "nHead": 4, "blockSize": 32}


@dataclass
class TrainerRun:
    returncode: int
    output: str

    @property
    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.output.splitlines():
            start = line.find('{"event"')
            if start >= 0:
                try:
                    found.append(json.loads(line[start:]))
                except json.JSONDecodeError:
                    continue
        return found

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def losses(self) -> dict[int, float]:
        """Loss by step; for a step seen twice (before and after a restart) the later value wins."""
        return {e["step"]: e["loss"] for e in self.of("step")}


def trainer_env(s3: S3Endpoint) -> dict[str, str]:
    env = dict(os.environ)
    env.update(s3.env())
    env.update(PYTHONSAFEPATH="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_RUN_ID", None)
    return env


def make_config(tmp_path: Path, bucket_uri: str, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "engine": "fsdp",
        "training": {"maxSteps": 12, "batchSize": 8, "learningRate": 0.003, "taskArgs": dict(TINY_MODEL)},
        "checkpoint": {"uri": bucket_uri, "everySteps": 4, "keepLast": 2,
                       "stagingDir": str(tmp_path / "staging")},
        "progress": {"file": str(tmp_path / "progress.json")},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def torchrun_argv(config_path: Path, nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        TORCHRUN, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5",
        "-m", "loom.workloads.trainer", "--config", str(config_path),
    ]


def write_wide_llama(folder: Path, seed: int, std: float = 0.3, max_positions: int = 128) -> Path:
    """A random-weight Hugging Face Llama (loom.workloads.llm.hf_model) whose weights are drawn wider than a fresh
    init (std 0.3, not 0.02): its logits have clear maxima, so a LoRA adapter on it visibly learns within a few CPU
    steps, and greedy decoding has no near-ties."""
    from loom.workloads.llm.hf_model import LlamaShape, random_weights, write_llama_folder

    shape = LlamaShape(max_positions=max_positions)
    weights = {name: value if name.endswith("norm.weight") else value * (std / 0.02)
               for name, value in random_weights(shape, seed).items()}
    return write_llama_folder(folder, shape, weights)
