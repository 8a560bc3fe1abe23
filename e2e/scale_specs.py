"""The objects the scale benchmarks (bench/) create by the hundred: placed on kwok's simulated nodes, so the
operator and the control plane do all their work while nothing runs."""

from __future__ import annotations

from typing import Any

from loom.devstack.cluster.nodes import kwok_placement
from loom.operator.api import API_VERSION


def training_job(name: str, workers: int = 2) -> dict[str, Any]:
    """The bundled tiny GPT's TrainingJob with `workers` CPU workers: the stack's kwok nodes have 32 GPUs, far
    fewer than a benchmark's workers."""
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
            "workers": {"replicas": workers, **kwok_placement()},
        },
    }


def plain_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A bare pod with one container, as a job's worker would be: the baseline of what the API server costs alone."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            **kwok_placement(),
            "containers": [{"name": "c", "image": "loom/trainer:0.1.0", "command": ["torchrun"]}],
        },
    }
