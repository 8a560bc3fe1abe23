"""Reads the trainer's progress from worker 0 (rank 0) over HTTP, in the background of the passes.

Contract with the trainer (workloads/trainer/tracking.py): rank 0 serves on PROGRESS_PORT either the
progress document as JSON (step, totalSteps, loss, samplesPerSecond, eta, latestCheckpoint {uri, step}) or
its Prometheus gauges (loom_trainer_*); both are understood. The operator reaches the pod by its IP, like a
Prometheus scrape. A failed read is not an error: the last known progress stays in status.

A pass never waits on a pod (`ProgressPoller`): it reads the last answer and, when that is stale, starts a poll
that runs on its own; an answer the state machine acts on (the first, a new trainer phase, a newer checkpoint,
an upload retry) triggers the job's next pass at once. Every job whose rank 0 runs is followed (`follow`): the
poller asks its rank 0 itself every training poll and any change of the answer triggers the job's pass. A steady
job (pacing.py) has no periodic pass, so that is how its status moves; a job that is not steady gets both, and
the follower's pass makes the resync skip it when it came less than half an interval before (core/runner.py).
Before #52 a job that was not steady showed the answer the poll its previous pass started got: up to two intervals
behind the trainer. Status shows the step and loss within one poll interval and a poll's own time of the
trainer's (held by tests/unit/test_trainingjob_progress_lag.py).
Before, each pass asked rank 0 itself and held its pass slot for up to the connect timeout when rank 0 did not
answer (a trainer still starting; in bench/bench_kubeflow_p1.py, every simulated pod). The client is aiohttp's,
not httpx's: 0.4 against 1.8-2.1 ms of CPU per request, answered or timed out (measured on this machine), and the
poll was the largest item of the operator's CPU in that bench after the garbage collector (8%).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from ....core.leadership import LEADERSHIP
from ..api import TrainingJobSpec, TrainingJobStatus
from ..config import PROGRESS_PORT, samples_per_step
from ..observe import ProgressReport, WorkerView, parse_progress, progress_from_metrics

log = logging.getLogger("loom.trainingjob.progress")
# Inside a cluster a pod's IP accepts a connection in milliseconds; one that does not within a second is not
# serving (a trainer still starting, a node gone).
TIMEOUT = aiohttp.ClientTimeout(total=2.0, sock_connect=1.0)


def new_client() -> aiohttp.ClientSession:
    """One pooled session for every poll. A pod's IP is never reached through a proxy (trust_env off: aiohttp would
    read the proxy variables and ~/.netrc again on every request)."""
    return aiohttp.ClientSession(timeout=TIMEOUT, trust_env=False)


async def fetch_progress(
    client: aiohttp.ClientSession,
    pod_ip: str,
    checkpoint_uri: str | None,
    port: int = PROGRESS_PORT,
    samples_per_step: int | None = None,
) -> ProgressReport | None:
    url = f"http://{pod_ip}:{port}/progress"
    try:
        async with client.get(url, headers={"Accept": "application/json"}) as response:
            if response.status != 200:
                return None
            text = await response.text()
            content_type = response.headers.get("content-type", "")
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as error:
        log.debug("progress of %s not available: %r", url, error)
        return None
    if "json" in content_type:
        try:
            return parse_progress(json.loads(text))
        except ValueError:
            return None
    return progress_from_metrics(text, checkpoint_uri, samples_per_step)


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

    def unanswered(self, job: tuple[str, str], target: Target) -> bool:
        """Whether this rank 0's last read got no answer (its backoff applies to every poller of it)."""
        last = self._last.get(job)
        return last is not None and last[1] == target and last[3] > 0

    def last(self, job: tuple[str, str], target: Target) -> ProgressReport | None:
        """The last answer recorded for this rank 0, however old (None: none yet, or its last read got none)."""
        last = self._last.get(job)
        return last[2] if last is not None and last[1] == target else None

    def forget(self, job: tuple[str, str]) -> None:
        self._last.pop(job, None)


def news(before: ProgressReport | None, after: ProgressReport | None) -> bool:
    """Whether an answer is worth the job's next pass now rather than at its periodic one: the first answer for a
    rank 0, and a change the state machine acts on (the trainer's phase: a restart waits for it to resume; a newer
    checkpoint; an upload retry starting, moving or ending). A step or a loss moving is not."""
    if after is None:
        return False
    if before is None:
        return True
    return (before.phase, before.latest_checkpoint, before.checkpoint_retry) != (
        after.phase,
        after.latest_checkpoint,
        after.checkpoint_retry,
    )


Job = tuple[str, str]  # (namespace, name)


Poll = tuple[Target, str | None, int | None]  # rank 0, the checkpoint URI, samples per step


class ProgressPoller:
    """Each job's rank 0, polled in the background of its passes (at most one poll per job at a time), its answers
    kept in `polls`; `on_news(namespace, name)` (the runner's trigger) runs as a task of its own when an answer is
    `news`, or for a job the poller follows (`follow`: every job whose rank 0 runs) when it changed."""

    def __init__(
        self,
        on_news: Callable[[str, str], Coroutine[Any, Any, None]],
        polls: RecentPolls | None = None,
        port: int = PROGRESS_PORT,
        interval_s: float = 5.0,
    ) -> None:
        self.on_news = on_news
        self.port = port
        self.interval_s = interval_s  # how often a followed job's rank 0 is asked (the training poll)
        self.polls = polls if polls is not None else RecentPolls()  # an empty one is falsy (it has a length)
        self._client: aiohttp.ClientSession | None = None
        self._polling: dict[Job, asyncio.Task[None]] = {}
        self._passes: set[asyncio.Task[None]] = set()  # triggered passes, referenced until done
        self._followed: dict[Job, Poll] = {}
        self._follower: asyncio.Task[None] | None = None

    @property
    def polling(self) -> frozenset[Job]:
        return frozenset(self._polling)

    def latest(
        self, job: Job, target: Target, checkpoint_uri: str | None, samples_per_step: int | None
    ) -> ProgressReport | None:
        """The last answer of this rank 0 (None before its first); a poll starts when it is stale and none runs."""
        self._start_poll(job, (target, checkpoint_uri, samples_per_step))
        return self.polls.last(job, target)

    def follow(self, job: Job, target: Target, checkpoint_uri: str | None, samples_per_step: int | None) -> None:
        """Poll this job's rank 0 every interval without being asked by a pass, and trigger its pass whenever the
        answer changes (every job whose rank 0 runs: a steady one has no periodic pass, and the periodic pass of
        one that is not steady would show an answer up to an interval old)."""
        self._followed[job] = (target, checkpoint_uri, samples_per_step)
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._follow_forever())

    def unfollow(self, job: Job) -> None:
        self._followed.pop(job, None)

    @property
    def followed(self) -> frozenset[Job]:
        return frozenset(self._followed)

    async def _follow_forever(self) -> None:
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while self._followed:
            # On a fixed schedule: a late wake-up (a busy loop) does not push every later tick back with it.
            tick = max(tick + self.interval_s, loop.time())
            await asyncio.sleep(tick - loop.time())
            if not await LEADERSHIP.leads():  # a replica standing by triggers no pass (core/leadership.py)
                continue
            for job, poll in list(self._followed.items()):
                self._start_poll(job, poll, reuse=False)

    def _start_poll(self, job: Job, poll: Poll, reuse: bool = True) -> None:
        """A poll of rank 0 as a task of its own, unless a poll runs already or (`reuse`: a pass asks) its last
        answer is fresh. The follower does not reuse an answer (one a pass got just before its tick would otherwise
        skip the tick, and status would lag the trainer by the interval and the reuse, #52); it keeps the backoff of
        a rank 0 that did not answer."""
        backoff = reuse or self.polls.unanswered(job, poll[0])  # a rank 0 that does not answer is asked less
        recent = backoff and self.polls.fresh(job, poll[0], time.monotonic())[0]
        if not recent and job not in self._polling:
            self._polling[job] = asyncio.get_running_loop().create_task(self._poll(job, *poll))

    async def _poll(self, job: Job, target: Target, checkpoint_uri: str | None, samples_per_step: int | None) -> None:
        try:
            if self._client is None or self._client.closed:
                self._client = new_client()
            asked = time.monotonic()
            report = await fetch_progress(self._client, target[0], checkpoint_uri, self.port, samples_per_step)
            before = self.polls.last(job, target)
            self.polls.record(job, target, asked, report)
        finally:
            if self._polling.get(job) is asyncio.current_task():
                del self._polling[job]
        if news(before, report) or (job in self._followed and report is not None and report != before):
            task = asyncio.get_running_loop().create_task(self.on_news(*job))
            self._passes.add(task)
            task.add_done_callback(self._passes.discard)

    def forget(self, job: Job) -> None:
        """The job was deleted: its answers go, and a poll still running for it is cancelled."""
        self.polls.forget(job)
        self._followed.pop(job, None)
        task = self._polling.pop(job, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Cancel what runs (a test's loop ends with it) and close the session."""
        tasks = [*self._polling.values(), *self._passes, *([self._follower] if self._follower else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()


def rank0_poll(
    spec: TrainingJobSpec, status: TrainingJobStatus, observed: list[tuple[WorkerView, str | None]]
) -> Poll | None:
    """What the progress poller asks while the job runs: rank 0 of the current attempt (its IP), the checkpoint
    URI and the samples per step its gauges are read with; None while rank 0 is not running."""
    if status.phase not in ("Running", "Restarting", "Created"):
        return None
    rank0 = next(
        (ip for v, ip in observed if v.index == 0 and v.attempt == status.attempt and v.phase == "Running" and ip),
        None,
    )
    if rank0 is None:
        return None
    workers = sum(1 for v, _ in observed if v.attempt == status.attempt)
    return (rank0, status.attempt), spec.checkpoint.uri if spec.checkpoint else None, samples_per_step(spec, workers)
