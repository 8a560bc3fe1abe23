"""The MLflow run of a TrainingJob (spec.tracking.mlflow), created through MLflow's REST API before any worker starts
and closed once the job finished.

The operator install stays light (no mlflow package). Runs are tagged with the job's UID and looked up by it
first, so an operator killed between creating the run and recording its id in status finds the same run
again instead of creating a second one; every retry and restart of the job logs into that one run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ....core.kit import Manifest

# The same tag and deadline as the model registry's (a run and the version registered from it name one job).
from ....core.model import JOB_UID_TAG
from ....core.registry import TIMEOUT
from ..api import TrainingJobSpec, TrainingJobStatus
from .api import MlflowRun

log = logging.getLogger("loom.trainingjob")
FINISHED = ("Succeeded", "Failed")


class TrackingError(Exception):
    """MLflow could not be reached or refused the request (reported as a condition, retried later)."""


@dataclass(frozen=True)
class RunRef:
    run_id: str
    url: str


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"/api/2.0/mlflow/{path}", json=body)
    if response.status_code >= 400:
        raise TrackingError(f"MLflow {path}: HTTP {response.status_code}: {response.text[:300]}")
    result: dict[str, Any] = response.json()
    return result


async def _experiment_id(client: httpx.AsyncClient, name: str) -> str:
    response = await client.get("/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name})
    if response.status_code == 200:
        return str(response.json()["experiment"]["experiment_id"])
    if response.status_code not in (400, 404):  # RESOURCE_DOES_NOT_EXIST comes back as 404 (older servers: 400)
        raise TrackingError(f"MLflow experiments/get-by-name: HTTP {response.status_code}: {response.text[:300]}")
    try:
        created = await _post(client, "experiments/create", {"name": name})
    except TrackingError:
        # Another job created it concurrently: read it back.
        again = await client.get("/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name})
        if again.status_code != 200:
            raise
        return str(again.json()["experiment"]["experiment_id"])
    return str(created["experiment_id"])


async def ensure_run(
    tracking_uri: str, experiment: str, *, job_uid: str, job_name: str, namespace: str, now_ms: int
) -> RunRef:
    """The job's run: found by its UID tag, or created (RUNNING) when there is none."""
    try:
        async with httpx.AsyncClient(base_url=tracking_uri.rstrip("/"), timeout=TIMEOUT) as client:
            experiment_id = await _experiment_id(client, experiment)
            found = await _post(
                client,
                "runs/search",
                {
                    "experiment_ids": [experiment_id],
                    "filter": f"tags.`{JOB_UID_TAG}` = '{job_uid}'",
                    "max_results": 1,
                },
            )
            runs = found.get("runs") or []
            if runs:
                run_id = str(runs[0]["info"]["run_id"])
            else:
                created = await _post(
                    client,
                    "runs/create",
                    {
                        "experiment_id": experiment_id,
                        "run_name": f"{namespace}/{job_name}",
                        "start_time": now_ms,
                        "tags": [
                            {"key": JOB_UID_TAG, "value": job_uid},
                            {"key": "loom.dev/trainingjob", "value": f"{namespace}/{job_name}"},
                            {"key": "mlflow.runName", "value": f"{namespace}/{job_name}"},
                        ],
                    },
                )
                run_id = str(created["run"]["info"]["run_id"])
    except httpx.HTTPError as error:
        raise TrackingError(f"MLflow at {tracking_uri} is unreachable: {error}") from error
    return RunRef(run_id=run_id, url=run_url(tracking_uri, experiment_id, run_id))


async def finish_run(tracking_uri: str, run_id: str, *, succeeded: bool, now_ms: int) -> None:
    """Mark the run FINISHED or FAILED once the job is over (best effort: the job's status is what counts)."""
    try:
        async with httpx.AsyncClient(base_url=tracking_uri.rstrip("/"), timeout=TIMEOUT) as client:
            await _post(
                client,
                "runs/update",
                {"run_id": run_id, "status": "FINISHED" if succeeded else "FAILED", "end_time": now_ms},
            )
    except httpx.HTTPError as error:
        raise TrackingError(f"MLflow at {tracking_uri} is unreachable: {error}") from error


async def ensure_tracking(job: Manifest, spec: TrainingJobSpec, status: TrainingJobStatus) -> str | None:
    """Create (or find) the MLflow run before any worker starts; its id goes into status with the rest. Returns why
    the run could not be created yet (None: it exists, or the job tracks nothing)."""
    mlflow = spec.tracking.mlflow if spec.tracking else None
    if mlflow is None or (status.mlflow and status.mlflow.run_id) or status.phase in FINISHED:
        return None
    assert mlflow.tracking_uri is not None  # defaulted, or reported as EndpointNotConfigured before this
    meta = job["metadata"]
    try:
        ref = await ensure_run(
            mlflow.tracking_uri,
            mlflow.experiment,
            job_uid=meta["uid"],
            job_name=meta["name"],
            namespace=meta["namespace"],
            now_ms=int(time.time() * 1000),
        )
    except TrackingError as error:
        log.warning("TrainingJob %s/%s: %s", meta["namespace"], meta["name"], error)
        return str(error)
    status.mlflow = MlflowRun(run_id=ref.run_id, url=ref.url)
    return None


async def close_run(spec: TrainingJobSpec, status: TrainingJobStatus) -> None:
    """The finished job's run marked FINISHED or FAILED."""
    run = status.mlflow
    mlflow = spec.tracking.mlflow if spec.tracking else None
    if mlflow is None or mlflow.tracking_uri is None or run is None or not run.run_id:
        return
    try:
        await finish_run(
            mlflow.tracking_uri,
            run.run_id,
            succeeded=status.phase == "Succeeded",
            now_ms=int(time.time() * 1000),
        )
    except TrackingError as error:
        log.warning("could not close MLflow run %s: %s", run.run_id, error)
