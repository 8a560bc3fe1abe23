"""Builders for tests and the demo: the example driver_stats view, a single-node store in one folder, and a real
vLLM embedding engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loom.workloads.features.config import FeaturesConfig
from loom.workloads.server.testing import running


def driver_view(source: str, ttl_seconds: int = 7200, **overrides: Any) -> dict[str, Any]:
    """The example FeatureView (camelCase contract) over ``example_data.driver_stats``."""
    view: dict[str, Any] = {
        "name": "driver_stats",
        "entities": [{"name": "driver", "joinKeys": ["driver_id"], "valueType": "Int64"}],
        "features": [
            {"name": "conv_rate", "dtype": "Float32"},
            {"name": "acc_rate", "dtype": "Float32"},
            {"name": "avg_daily_trips", "dtype": "Int64"},
        ],
        "source": {"path": source, "timestampField": "event_timestamp", "createdTimestampField": "created"},
        "ttlSeconds": ttl_seconds,
        "description": "hourly driver statistics",
        "tags": {"team": "rides"},
    }
    view.update(overrides)
    return view


def local_config(root: Path, views: list[dict[str, Any]], project: str = "demo", **overrides: Any) -> FeaturesConfig:
    """Registry file, sqlite online store and Feast's repo folder, all under ``root``."""
    document: dict[str, Any] = {
        "project": project,
        "featureViews": views,
        "registry": {"path": str(root / "registry.db")},
        "onlineStore": {"path": str(root / "online.db")},
        "repoPath": str(root / "repo"),
    }
    document.update(overrides)
    return FeaturesConfig.model_validate(document)


# vLLM's CPU platform starts fastest with the worker in the engine's own process (see workloads/llm/engine.py).
_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB: the CPU platform reserves 92% of memory otherwise


@contextlib.contextmanager
def embedding_engine(
    python: str, model_dir: Path, names: list[str], port: int, log: Path, timeout_s: float = 900.0
) -> Iterator[str]:
    """vLLM's OpenAI server serving the model in ``model_dir`` as an embedding model (the pooling runner, a causal
    LM converted with ``--convert embed``: last-token pooling, normalized) under each of ``names``; yields its URL
    once ``/health`` answers, and stops it afterwards."""
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", f"--model={model_dir}",
        "--served-model-name", *names, "--runner=pooling", "--convert=embed", "--dtype=float32", "--enforce-eager",
        "--max-model-len=256", "--host=127.0.0.1", f"--port={port}", "--distributed-executor-backend=uni",
    ]
    url = f"http://127.0.0.1:{port}"
    with running(argv, url, log, env=_ENGINE_ENV, timeout_s=timeout_s, ready_url=f"{url}/health"):
        yield url
