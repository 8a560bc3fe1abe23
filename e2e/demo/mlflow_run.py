"""What the demo reads back from the TrainingJob's MLflow run: the loss history and the resumes the trainer tagged.

The trainer tags each resume as `loom.resume.<gang attempt>.<torchrun restart>` = `<checkpoint uri>@<step>`
(workloads/trainer/duties.py), so the step a restart resumed from is the run's own record, not a guess from
polling the status. (Trainers before the gang attempt was known wrote `loom.resume.<torchrun restart>`.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

RESUME_TAG = "loom.resume."


@dataclass(frozen=True)
class Resume:
    attempt: tuple[int, ...]  # the tag's numbers: (gang attempt, torchrun restart inside it)
    step: int  # the checkpoint's step training went on from
    uri: str  # the checkpoint


def _get(mlflow_url: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
    response = httpx.get(f"{mlflow_url}/api/2.0/mlflow/{path}", params=params, timeout=30, trust_env=False)
    response.raise_for_status()
    return dict(response.json())


def loss_history(mlflow_url: str, run_id: str) -> list[dict[str, Any]]:
    doc = _get(mlflow_url, "metrics/get-history", {"run_id": run_id, "metric_key": "loss", "max_results": 10000})
    return sorted(doc.get("metrics", []), key=lambda m: (m["timestamp"], m["step"]))


def run_tags(mlflow_url: str, run_id: str) -> dict[str, str]:
    run = _get(mlflow_url, "runs/get", {"run_id": run_id})["run"]
    return {t["key"]: t["value"] for t in (run.get("data") or {}).get("tags", [])}


def resumes(tags: dict[str, str]) -> list[Resume]:
    """The run's resumes in order; tags that do not parse are not resumes (a person may add tags)."""
    found = []
    for key, value in tags.items():
        numbers = key.removeprefix(RESUME_TAG).split(".")
        uri, _, step = value.rpartition("@")
        if key.startswith(RESUME_TAG) and all(n.isdigit() for n in numbers) and step.isdigit() and uri:
            found.append(Resume(tuple(int(n) for n in numbers), int(step), uri))
    return sorted(found, key=lambda r: r.attempt)


def kill_mark(kill_step: int, resumed: list[Resume]) -> int:
    """The step the demo names for the kill, never before the checkpoint the restart went on from: that checkpoint
    was written before the worker died, so a kill drawn before it would contradict the run's own record. (The kill
    step comes from the trainer's log; this bound holds even when that read failed and the status's step, a poll
    behind, stood in.)"""
    if not kill_step:
        return kill_step
    first = resumed[0].step if resumed else 0
    return max(kill_step, first)
