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


# How long one answer of rank 0 stands for a job. A burst of watch events (each worker's creation, scheduling and
# start, the job's own status writes) runs several passes of one job a second, and each asked rank 0 again: in a
# burst of 200 jobs a tenth of the operator's CPU. Progress moves by steps of seconds, and a job that is not idle
# is reconciled every training_poll_s (5 s) anyway.
PROGRESS_REUSE_S = 2.0

Target = tuple[str, int]  # rank 0's pod IP and the attempt it belongs to


class RecentPolls:
    """The last answer of each job's rank 0 and when it came, reused for PROGRESS_REUSE_S while rank 0 is the same
    pod (IP and attempt); a job's entry goes when the job is deleted, so memory stays bounded."""

    def __init__(self, reuse_s: float = PROGRESS_REUSE_S) -> None:
        self.reuse_s = reuse_s
        self._last: dict[tuple[str, str], tuple[float, Target, ProgressReport | None]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def fresh(self, job: tuple[str, str], target: Target, now: float) -> tuple[bool, ProgressReport | None]:
        """(True, the answer) when rank 0 answered this recently; (False, None) when it must be asked."""
        last = self._last.get(job)
        if last is None or last[1] != target or not 0 <= now - last[0] < self.reuse_s:
            return False, None
        return True, last[2]

    def record(self, job: tuple[str, str], target: Target, now: float, report: ProgressReport | None) -> None:
        self._last[job] = (now, target, report)

    def forget(self, job: tuple[str, str]) -> None:
        self._last.pop(job, None)
