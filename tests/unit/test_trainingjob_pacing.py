"""Which TrainingJobs the periodic resync may leave to their triggers (kinds/trainingjob/pacing.py): only a healthy
running one, on the decisions of the real state machine."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from loom.operator.kinds.trainingjob.api import TrainingJobStatus
from loom.operator.kinds.trainingjob.decision import Observation, Policy
from loom.operator.kinds.trainingjob.observe import NodeView, ProgressReport, UploadRetryReport, WorkerView
from loom.operator.kinds.trainingjob.pacing import steady
from loom.operator.kinds.trainingjob.state import decide

from .test_trainingjob_state import NOW, spec, step, worker


def observe(status: TrainingJobStatus, pods: tuple[WorkerView, ...], **kw: Any) -> Observation:
    fields: dict[str, Any] = {"generation": 1, "spec": spec(), "status": status, "pods": pods, "now": NOW}
    fields.update(kw)
    return Observation(**fields)


def is_steady(status: TrainingJobStatus, pods: tuple[WorkerView, ...], **kw: Any) -> bool:
    obs = observe(status, pods, **kw)
    return steady(obs, decide(obs, Policy(node_lost_grace_seconds=60)))


def created() -> TrainingJobStatus:
    return step().status


def running() -> TrainingJobStatus:
    return step(created(), (worker(0), worker(1))).status


def test_a_job_running_every_worker_on_ready_nodes_is_steady() -> None:
    both = (worker(0), worker(1))
    assert is_steady(created(), both)  # the pass that sees it running: nothing moves with the clock after it
    assert is_steady(running(), both, nodes={"node-0": NodeView("node-0", True, None)})
    assert is_steady(running(), both, progress=ProgressReport(step=40, loss=1.5, phase="Running"))


def test_a_job_that_waits_for_anything_the_clock_decides_is_not() -> None:
    both = (worker(0), worker(1))
    assert not is_steady(TrainingJobStatus(), ())  # new: its workers are being created
    assert not is_steady(created(), (worker(0), worker(1, phase="Pending")))  # one still starting
    assert not is_steady(running(), (worker(0),))  # one missing: it is being replaced
    assert not is_steady(running(), (worker(0), worker(1, ready=False)))
    assert not is_steady(running(), (worker(0), worker(1, deleting=True)))
    # A node NotReady: its grace period runs with the clock.
    lost = {"node-1": NodeView("node-1", False, NOW - timedelta(seconds=10))}
    assert not is_steady(running(), both, nodes=lost)
    # activeDeadlineSeconds runs with the clock too.
    assert not is_steady(running(), both, spec=spec(runPolicy={"activeDeadlineSeconds": 3600}))
    # The trainer restarting (its resume waits with a timeout), checkpoints retrying their upload.
    assert not is_steady(running(), both, progress=ProgressReport(step=0, phase="Starting"))
    retrying = ProgressReport(step=40, phase="Running", checkpoint_retry=UploadRetryReport(2))
    assert not is_steady(running(), both, progress=retrying)
    # Something outside the watch streams: MLflow not reachable yet, an endpoint nobody named.
    assert not is_steady(running(), both, tracking_error="MLflow unreachable")
    assert not is_steady(running(), both, endpoint_problem="no S3 endpoint")


def test_a_finished_or_failing_job_is_not() -> None:
    done = (worker(0, phase="Succeeded"), worker(1, phase="Succeeded"))
    assert not is_steady(running(), done)
    failed = (worker(0), worker(1, phase="Failed", exit_code=1))
    assert not is_steady(running(), failed)


def test_a_node_readiness_change_reaches_the_jobs_with_a_worker_on_it() -> None:
    # A steady job has no periodic pass: the node index's handler triggers these jobs when a node's readiness changes.
    from loom.operator.kinds.trainingjob.controller import jobs_with_workers_on

    def on(node: str | None, name: str) -> tuple[WorkerView, str | None]:
        return WorkerView(name=name, uid=name, index=0, attempt=0, phase="Running", node_name=node), None

    pods = {
        ("ml", "a"): [on("n1", "a-0"), on("n2", "a-1")],
        ("ml", "b"): [on("n2", "b-0")],
        ("ml", "c"): [on(None, "c")],  # not scheduled yet
    }
    assert jobs_with_workers_on(pods, "n2") == [("ml", "a"), ("ml", "b")]
    assert jobs_with_workers_on(pods, "n1") == [("ml", "a")]
    assert jobs_with_workers_on(pods, "n3") == [] and jobs_with_workers_on(None, "n1") == []
