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
# Inside a cluster a pod's IP accepts a connection in milliseconds; one that does not within a second is not
# serving (a trainer still starting, a node gone), and a pass must not wait longer for it.
TIMEOUT = httpx.Timeout(2.0, connect=1.0)


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
# A rank 0 that did not answer is asked again after twice as long each time (2, 4, 8 s), at most this long apart:
# a trainer still loading a large model, or a pod that never serves, costs a pass its wait (up to the connect
# timeout) once per 8 s instead of every pass; a trainer that starts serving is seen at most 8 s late. An answer
# ends the backoff.
UNANSWERED_MAX_REUSE_S = 8.0

Target = tuple[str, int]  # rank 0's pod IP and the attempt it belongs to


class RecentPolls:
    """The last answer of each job's rank 0 and when it came, reused for PROGRESS_REUSE_S while rank 0 is the same
    pod (IP and attempt), longer after reads that got no answer (UNANSWERED_MAX_REUSE_S); a job's entry goes when
    the job is deleted, so memory stays bounded."""

    def __init__(self, reuse_s: float = PROGRESS_REUSE_S, unanswered_max_s: float = UNANSWERED_MAX_REUSE_S) -> None:
        self.reuse_s = reuse_s
        self.unanswered_max_s = unanswered_max_s
        # job -> (when, rank 0, its answer, reads in a row without one)
        self._last: dict[tuple[str, str], tuple[float, Target, ProgressReport | None, int]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def fresh(self, job: tuple[str, str], target: Target, now: float) -> tuple[bool, ProgressReport | None]:
        """(True, the answer) when rank 0 answered this recently; (False, None) when it must be asked."""
        last = self._last.get(job)
        if last is None or last[1] != target:
            return False, None
        when, _, report, unanswered = last
        reuse_s = self.reuse_s if not unanswered else min(self.unanswered_max_s, self.reuse_s * 2 ** (unanswered - 1))
        return (True, report) if 0 <= now - when < reuse_s else (False, None)

    def record(self, job: tuple[str, str], target: Target, now: float, report: ProgressReport | None) -> None:
        last = self._last.get(job)
        before = last[3] if last is not None and last[1] == target else 0
        self._last[job] = (now, target, report, 0 if report is not None else before + 1)

    def forget(self, job: tuple[str, str]) -> None:
        self._last.pop(job, None)
