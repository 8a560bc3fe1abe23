"""Reads the trainer's progress from worker 0 (rank 0) over HTTP.

Contract with the trainer (workloads/trainer/tracking.py): rank 0 serves on PROGRESS_PORT either the
progress document as JSON (step, totalSteps, loss, samplesPerSecond, eta, latestCheckpoint {uri, step}) or
its Prometheus gauges (loom_trainer_*); both are understood. The operator reaches the pod by its IP, like a
Prometheus scrape. A failed read is not an error: the last known progress stays in status.
"""

from __future__ import annotations

import logging

import httpx

from .config import PROGRESS_PORT
from .observe import ProgressReport, parse_progress, progress_from_metrics

log = logging.getLogger("loom.trainingjob.progress")
TIMEOUT = httpx.Timeout(2.0)


def new_client() -> httpx.AsyncClient:
    """One pooled client for every poll (a client per request would redo TLS/pool setup each time)."""
    return httpx.AsyncClient(timeout=TIMEOUT)


async def fetch_progress(
    client: httpx.AsyncClient,
    pod_ip: str,
    checkpoint_uri: str | None,
    port: int = PROGRESS_PORT,
    samples_per_step: int | None = None,
) -> ProgressReport | None:
    url = f"http://{pod_ip}:{port}/progress"
    try:
        response = await client.get(url, headers={"Accept": "application/json"})
    except httpx.HTTPError as error:
        log.debug("progress of %s not available: %s", url, error)
        return None
    if response.status_code != 200:
        return None
    if "json" in response.headers.get("content-type", ""):
        try:
            return parse_progress(response.json())
        except ValueError:
            return None
    return progress_from_metrics(response.text, checkpoint_uri, samples_per_step)
