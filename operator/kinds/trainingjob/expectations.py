"""Worker pods a pass created that the pod index does not show yet: not created again meanwhile.

A pass reads a job's workers from Kopf's pod index, which the watch keeps current; a pod created a moment ago is
there only once its ADDED event has been processed. Passes come that fast: the first worker's ADDED event
triggers the job's next pass while the second worker's event is still queued, and the state machine, seeing one
worker, decided to create the other again. Server-side apply made that harmless (the same pod, converged) but not
free: in a burst of 200 TrainingJobs of two workers, 616 pod applies for 400 pods, each a full server-side apply
of a pod on the API server (bench/bench_kubeflow_p1.py, apiserver_request_total). Kubernetes' own controllers keep
"expectations" for the same reason.

A pod is expected from its creation until the index shows it (that name, that attempt) or EXPECT_S passes: a pod
deleted before the watch ever showed it is created again after at most that long. Pure: the clock is handed in.
"""

from __future__ import annotations

from collections.abc import Iterable

Job = tuple[str, str]  # (namespace, name)
Worker = tuple[str, int]  # (pod name, attempt)
EXPECT_S = 30.0


class CreatedWorkers:
    def __init__(self, expect_s: float = EXPECT_S) -> None:
        self.expect_s = expect_s
        self._created: dict[Job, dict[Worker, float]] = {}

    def __len__(self) -> int:
        return len(self._created)

    def created(self, job: Job, workers: Iterable[Worker], now: float) -> None:
        """These pods were just applied (created) for the job."""
        self._created.setdefault(job, {}).update((worker, now) for worker in workers)

    def expected(self, job: Job, seen: Iterable[Worker], now: float) -> frozenset[Worker]:
        """The job's pods created less than expect_s ago that `seen` (the index's workers) does not hold yet; the
        others are dropped: shown once, a pod is the index's to report from then on."""
        created = self._created.get(job)
        if not created:
            return frozenset()
        shown = set(seen)
        for worker, at in list(created.items()):
            if worker in shown or now - at > self.expect_s:
                del created[worker]
        if not created:
            del self._created[job]
            return frozenset()
        return frozenset(created)

    def forget(self, job: Job) -> None:
        self._created.pop(job, None)
