"""Read a run back from an MLflow tracking server over its REST API (httpx; no mlflow package needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class MlflowError(RuntimeError):
    pass


@dataclass(frozen=True)
class Point:
    step: int
    value: float
    timestamp_ms: int


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    source: str | None = None
    aliases: tuple[str, ...] = field(default_factory=tuple)


def tracking_uri_of(run_url: str) -> str:
    """The tracking server of a run page URL (`<tracking>/#/experiments/<e>/runs/<r>`, as status.mlflow.url)."""
    return run_url.split("/#/", 1)[0].rstrip("/")


class MlflowReader:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def _get(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        try:
            response = httpx.get(f"{self.base_url}{path}", params=params, timeout=TIMEOUT, trust_env=False)
        except httpx.HTTPError as error:
            raise MlflowError(f"MLflow at {self.base_url} is unreachable: {error}") from error
        if response.status_code != 200:
            raise MlflowError(f"MLflow answered {response.status_code} to {path}: {response.text[:300]}")
        return dict(response.json())

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self._get("/api/2.0/mlflow/runs/get", {"run_id": run_id})["run"])

    def latest_metrics(self, run_id: str) -> dict[str, float]:
        metrics = self.run(run_id).get("data", {}).get("metrics") or []
        return {m["key"]: float(m["value"]) for m in metrics}

    def tags(self, run_id: str) -> dict[str, str]:
        tags = self.run(run_id).get("data", {}).get("tags") or []
        return {t["key"]: str(t["value"]) for t in tags}

    def history(self, run_id: str, key: str) -> list[Point]:
        points: list[Point] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"run_id": run_id, "metric_key": key, "max_results": 25000}
            if token:
                params["page_token"] = token
            page = self._get("/api/2.0/mlflow/metrics/get-history", params)
            points += [Point(int(m.get("step", 0)), float(m["value"]), int(m.get("timestamp", 0)))
                       for m in page.get("metrics") or []]
            token = page.get("next_page_token")
            if not token:
                break
        # A step logged again after a resume: the later value wins, as the loss curve shows it.
        by_step: dict[int, Point] = {}
        for point in sorted(points, key=lambda p: (p.step, p.timestamp_ms)):
            by_step[point.step] = point
        return list(by_step.values())

    def registered_versions(self, run_id: str) -> list[RegisteredVersion]:
        page = self._get("/api/2.0/mlflow/model-versions/search", {"filter": f"run_id='{run_id}'"})
        return [
            RegisteredVersion(v["name"], str(v["version"]), v.get("source"), tuple(v.get("aliases") or ()))
            for v in page.get("model_versions") or []
        ]


def ensure_run(tracking_uri: str, experiment: str, *, run_name: str, key_tag: tuple[str, str]) -> tuple[str, str]:
    """(run id, run page URL) of the run tagged `key_tag`, created when there is none: what the operator does
    before a job's pods start, so a restarted run logs into the same run."""
    base = tracking_uri.rstrip("/")

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = httpx.post(f"{base}/api/2.0/mlflow/{path}", json=body, timeout=TIMEOUT, trust_env=False)
        except httpx.HTTPError as error:
            raise MlflowError(f"MLflow at {base} is unreachable: {error}") from error
        if response.status_code != 200:
            raise MlflowError(f"MLflow answered {response.status_code} to {path}: {response.text[:300]}")
        return dict(response.json())

    reader = MlflowReader(base)
    try:
        found = reader._get("/api/2.0/mlflow/experiments/get-by-name", {"experiment_name": experiment})
        experiment_id = str(found["experiment"]["experiment_id"])
    except MlflowError as error:
        if "RESOURCE_DOES_NOT_EXIST" not in str(error):
            raise
        experiment_id = str(post("experiments/create", {"name": experiment})["experiment_id"])
    tag, value = key_tag
    runs = post("runs/search", {"experiment_ids": [experiment_id], "filter": f"tags.`{tag}` = '{value}'",
                                "max_results": 1}).get("runs") or []
    if runs:
        run_id = str(runs[0]["info"]["run_id"])
    else:
        created = post("runs/create", {
            "experiment_id": experiment_id,
            "run_name": run_name,
            "tags": [{"key": tag, "value": value}, {"key": "mlflow.runName", "value": run_name}],
        })
        run_id = str(created["run"]["info"]["run_id"])
    return run_id, f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def set_run_status(tracking_uri: str, run_id: str, status: str, end_time_ms: int | None = None) -> None:
    """RUNNING, FINISHED or FAILED, as the operator marks a job's run when the job starts and ends."""
    body: dict[str, Any] = {"run_id": run_id, "status": status}
    if end_time_ms is not None:
        body["end_time"] = end_time_ms
    try:
        response = httpx.post(f"{tracking_uri.rstrip('/')}/api/2.0/mlflow/runs/update", json=body, timeout=TIMEOUT,
                              trust_env=False)
    except httpx.HTTPError as error:
        raise MlflowError(f"MLflow at {tracking_uri} is unreachable: {error}") from error
    if response.status_code != 200:
        raise MlflowError(f"MLflow answered {response.status_code} to runs/update: {response.text[:300]}")
