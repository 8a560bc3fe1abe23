"""The TrainingJob state machine, transition by transition (pure: no cluster, no clock)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from loom.operator.core.kit import status_patch
from loom.operator.kinds.trainingjob.api import TrainingJobSpec, TrainingJobStatus
from loom.operator.kinds.trainingjob.decision import Decision, Delete, Observation, Policy
from loom.operator.kinds.trainingjob.observe import CheckpointReport, NodeView, ProgressReport, WorkerView
from loom.operator.kinds.trainingjob.render import ATTEMPT_LABEL, INDEX_LABEL
from loom.operator.kinds.trainingjob.state import decide

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def spec(**overrides: Any) -> TrainingJobSpec:
    base: dict[str, Any] = {"engine": "fsdp", "entrypoint": {"module": "m:task"}, "workers": {"replicas": 2}}
    base.update(overrides)
    return TrainingJobSpec.model_validate(base)


def worker(index: int, attempt: int = 0, phase: str = "Running", **kw: Any) -> WorkerView:
    defaults: dict[str, Any] = {
        "name": f"job-worker-{index}",
        "uid": f"uid-{attempt}-{index}",
        "index": index,
        "attempt": attempt,
        "phase": phase,
        "ready": phase == "Running",
        "node_name": f"node-{index}",
        "created": NOW - timedelta(minutes=5),
    }
    defaults.update(kw)
    return WorkerView(**defaults)


def step(
    status: TrainingJobStatus | None = None,
    pods: tuple[WorkerView, ...] = (),
    the_spec: TrainingJobSpec | None = None,
    now: datetime = NOW,
    **kw: Any,
) -> Decision:
    return decide(
        Observation(
            generation=1,
            spec=the_spec or spec(),
            status=status or TrainingJobStatus(),
            pods=pods,
            now=now,
            **kw,
        ),
        Policy(node_lost_grace_seconds=60, resume_timeout_seconds=600),
    )


def cond(decision: Decision, kind: str) -> tuple[str, str]:
    for c in decision.status.conditions:
        if c.type == kind:
            return c.status, c.reason
    raise AssertionError(f"no {kind} condition")


def running(status: TrainingJobStatus | None = None, **kw: Any) -> Decision:
    """A job whose two workers of attempt 0 are running."""
    created = step(status)
    return step(created.status, (worker(0), worker(1)), **kw)


# ---- start -----------------------------------------------------------------------------------------------


def test_new_job_creates_every_worker() -> None:
    d = step()
    assert d.create == [0, 1]
    assert d.status.phase == "Created"
    assert d.status.start_time == "2026-03-01T12:00:00Z"
    assert cond(d, "Created") == ("True", "WorkersCreated")
    assert cond(d, "Ready")[0] == "False"
    assert {c.observed_generation for c in d.status.conditions} == {1}
    assert [e.reason for e in d.events] == ["Created"]


def test_waits_for_mlflow_run_before_any_pod() -> None:
    d = step(tracking_ready=False)
    assert d.create == []
    assert d.status.phase == "Pending"
    assert cond(d, "Ready") == ("False", "WaitingForTracking")


def test_all_workers_running_is_ready() -> None:
    d = running()
    assert d.status.phase == "Running"
    assert d.status.workers is not None and (d.status.workers.desired, d.status.workers.ready) == (2, 2)
    assert cond(d, "Ready") == ("True", "WorkersRunning")
    assert cond(d, "Running") == ("True", "WorkersRunning")
    assert d.create == [] and d.delete == []
    assert "Running" in [e.reason for e in d.events]


def test_reconcile_is_idempotent_when_nothing_changes() -> None:
    first = running()
    again = step(first.status, (worker(0), worker(1)))
    assert again.status == first.status
    assert again.events == [] and again.create == [] and again.delete == []


def test_pods_not_seen_yet_are_applied_again_not_counted() -> None:
    created = step()
    again = step(created.status)  # the informer has not caught up: same names, server-side apply is a no-op
    assert again.create == [0, 1]
    assert again.status.restarts == 0 and again.status.failures == 0


def test_invalid_spec_fails_with_reason() -> None:
    d = step(spec_error="entrypoint.args entry 'x' is not key=value")
    assert d.status.phase == "Failed"
    assert cond(d, "Failed") == ("True", "InvalidSpec")
    assert d.create == []


# ---- success ---------------------------------------------------------------------------------------------


def test_all_workers_success_policy() -> None:
    r = running()
    partial = step(r.status, (worker(0, phase="Succeeded"), worker(1)))
    assert partial.status.phase == "Running"
    done = step(r.status, (worker(0, phase="Succeeded"), worker(1, phase="Succeeded")))
    assert done.status.phase == "Succeeded"
    assert done.status.completion_time == "2026-03-01T12:00:00Z"
    assert cond(done, "Succeeded") == ("True", "AllWorkersSucceeded")
    assert cond(done, "Ready")[0] == "True"
    assert done.status.workers is not None and done.status.workers.desired == 0


def test_success_records_the_checkpoint_the_trainer_names_on_exit() -> None:
    """The last checkpoint commits after the last progress poll: the trainer's exit message is the truth."""
    polled = TrainingJobStatus.model_validate(
        running().status.to_wire() | {"checkpoint": {"latest": "s3://b/j/step-100", "step": 100}}
    )
    final = CheckpointReport(uri="s3://b/j/step-120", step=120, time="2026-03-01T11:59:00Z")
    done = step(polled, (worker(0, phase="Succeeded", final_checkpoint=final), worker(1, phase="Succeeded")))
    assert done.status.phase == "Succeeded"
    assert done.status.checkpoint is not None
    assert (done.status.checkpoint.latest, done.status.checkpoint.step) == ("s3://b/j/step-120", 120)
    stale = CheckpointReport(uri="s3://b/j/step-080", step=80)
    kept = step(polled, (worker(0, phase="Succeeded", final_checkpoint=stale), worker(1, phase="Succeeded")))
    assert kept.status.checkpoint is not None and kept.status.checkpoint.step == 100


def test_success_records_the_step_and_loss_the_trainer_names_on_exit() -> None:
    """A job of a few seconds ends before any poll saw a step: the exit message's step and loss are in status."""
    finished = worker(0, phase="Succeeded", final_loss=1.25, final_step=20)
    never_polled = step(running().status, (finished, worker(1, phase="Succeeded")))
    assert never_polled.status.progress is not None
    assert (never_polled.status.progress.step, never_polled.status.progress.loss) == (20, 1.25)
    polled = TrainingJobStatus.model_validate(
        running().status.to_wire() | {"progress": {"step": 90, "totalSteps": 100, "loss": 2.5}}
    )
    done = step(polled, (worker(0, phase="Succeeded", final_loss=1.75), worker(1, phase="Succeeded")))
    assert done.status.progress is not None
    assert (done.status.progress.step, done.status.progress.loss) == (100, 1.75)
    silent = step(polled, (worker(0, phase="Succeeded"), worker(1, phase="Succeeded")))  # an older trainer
    assert silent.status.progress is not None and silent.status.progress.loss == 2.5


def test_a_gang_winding_down_stays_running() -> None:
    """Worker 0 done, worker 1 unready while it exits: Running, not back to Created (status must not lie)."""
    r = running()
    winding = step(r.status, (worker(0, phase="Succeeded"), worker(1, ready=False)))
    assert winding.status.phase == "Running"
    assert not winding.create and not winding.delete


def test_worker0_success_policy_stops_the_rest() -> None:
    r = running(the_spec=spec(successPolicy="Worker0"))
    d = step(r.status, (worker(0, phase="Succeeded"), worker(1)), the_spec=spec(successPolicy="Worker0"))
    assert d.status.phase == "Succeeded"
    assert cond(d, "Succeeded") == ("True", "Worker0Succeeded")
    assert d.delete == [Delete("job-worker-1", "uid-0-1")]


def test_finished_keeps_its_reason_on_later_reconciles() -> None:
    r = running()
    done = step(r.status, (worker(0, phase="Succeeded"), worker(1, phase="Succeeded")))
    later = step(
        done.status, (worker(0, phase="Succeeded"), worker(1, phase="Succeeded")), now=NOW + timedelta(hours=1)
    )
    assert later.status.phase == "Succeeded"
    assert cond(later, "Succeeded") == ("True", "AllWorkersSucceeded")
    assert later.create == [] and later.delete == [] and later.events == []


# ---- failures and recovery -------------------------------------------------------------------------------


def test_failed_worker_with_too_few_survivors_restarts_the_gang() -> None:
    r = running()
    d = step(r.status, (worker(0), worker(1, phase="Failed", exit_code=1, ready=False)))
    assert d.status.phase == "Restarting"
    assert (d.status.restarts, d.status.failures, d.status.attempt) == (1, 1, 1)
    assert {x.name for x in d.delete} == {"job-worker-0", "job-worker-1"}
    assert cond(d, "Restarting") == ("True", "GangRestart")
    assert [e.reason for e in d.events] == ["GangRestart"]
    # Old pods still terminating: nothing is created under the same names yet.
    waiting = step(d.status, (worker(0, deleting=True), worker(1, phase="Failed", exit_code=1)))
    assert waiting.create == [] and waiting.status.phase == "Restarting"
    assert (waiting.status.restarts, waiting.status.failures) == (1, 1)
    # Old pods gone: the new attempt's workers are created.
    fresh = step(waiting.status, ())
    assert fresh.create == [0, 1]
    assert fresh.status.phase == "Restarting"
    back = step(fresh.status, (worker(0, attempt=1), worker(1, attempt=1)))
    assert back.status.phase == "Running"
    assert cond(back, "Restarting")[0] == "False"
    assert "Recovered" in [e.reason for e in back.events]
    assert (back.status.restarts, back.status.failures) == (1, 1)


def test_elastic_survivors_continue_and_only_the_lost_worker_is_replaced() -> None:
    elastic = spec(workers={"replicas": 3, "minReplicas": 2})
    created = step(the_spec=elastic)
    r = step(created.status, (worker(0), worker(1), worker(2)), the_spec=elastic)
    failed = worker(2, phase="Failed", exit_code=1, ready=False)
    d = step(r.status, (worker(0), worker(1), failed), the_spec=elastic)
    assert d.delete == [Delete("job-worker-2", "uid-0-2")]
    assert (d.status.restarts, d.status.failures, d.status.attempt) == (1, 1, 0)
    assert d.status.replaced_pods == ["uid-0-2"]
    assert cond(d, "Restarting") == ("True", "WorkerReplaced")
    # The failed pod is still listed while its delete completes: it is not counted twice.
    again = step(d.status, (worker(0), worker(1), failed), the_spec=elastic)
    assert (again.status.restarts, again.status.failures) == (1, 1)
    assert again.create == []
    gone = step(again.status, (worker(0), worker(1)), the_spec=elastic)
    assert gone.create == [2]
    assert gone.status.replaced_pods == []
    back = step(gone.status, (worker(0), worker(1), worker(2, uid="new")), the_spec=elastic)
    assert back.status.phase == "Running"


def test_losing_worker0_always_restarts_the_gang() -> None:
    elastic = spec(workers={"replicas": 3, "minReplicas": 1})
    r = step(step(the_spec=elastic).status, (worker(0), worker(1), worker(2)), the_spec=elastic)
    d = step(r.status, (worker(0, phase="Failed", exit_code=1), worker(1), worker(2)), the_spec=elastic)
    assert d.status.attempt == 1
    assert len(d.delete) == 3


def test_permanent_exit_code_fails_fast() -> None:
    r = running()
    d = step(r.status, (worker(0), worker(1, phase="Failed", exit_code=2, message="cannot import task")))
    assert d.status.phase == "Failed"
    assert cond(d, "Failed") == ("True", "PermanentError")
    assert "cannot import task" in d.status.conditions[-1].message or "cannot import task" in str(d.status.conditions)
    assert d.status.failures == 0 and d.status.restarts == 0
    assert d.delete == [Delete("job-worker-0", "uid-0-0")]


def test_backoff_limit_exhaustion_fails_and_never_resets() -> None:
    job = spec(runPolicy={"backoffLimit": 1})
    r = step(step(the_spec=job).status, (worker(0), worker(1)), the_spec=job)
    first = step(r.status, (worker(0), worker(1, phase="Failed", exit_code=1)), the_spec=job)
    assert first.status.failures == 1 and first.status.phase == "Restarting"
    restarted = step(first.status, (), the_spec=job)
    up = step(restarted.status, (worker(0, attempt=1), worker(1, attempt=1)), the_spec=job)
    assert up.status.phase == "Running" and up.status.failures == 1  # running again does not reset the budget
    second = step(up.status, (worker(0, attempt=1, phase="Failed", exit_code=1), worker(1, attempt=1)), the_spec=job)
    assert second.status.phase == "Failed"
    assert cond(second, "Failed") == ("True", "BackoffLimitExceeded")
    assert second.status.failures == 2
    assert second.delete == [Delete("job-worker-1", "uid-1-1")]
    assert "BackoffLimitExceeded" in [e.reason for e in second.events]


def test_disruptions_do_not_consume_the_backoff_limit() -> None:
    job = spec(runPolicy={"backoffLimit": 0})
    r = step(step(the_spec=job).status, (worker(0), worker(1)), the_spec=job)
    d = step(r.status, (worker(0), worker(1, phase="Failed", reason="Evicted", disrupted=True)), the_spec=job)
    assert d.status.phase == "Restarting"
    assert (d.status.failures, d.status.restarts) == (0, 1)


def test_one_incident_counts_one_failure_however_many_workers_died() -> None:
    r = running()
    d = step(r.status, (worker(0, phase="Failed", exit_code=1), worker(1, phase="Failed", exit_code=1)))
    assert (d.status.failures, d.status.restarts) == (1, 1)


# ---- nodes -----------------------------------------------------------------------------------------------


def test_worker_on_not_ready_node_is_force_deleted_after_grace() -> None:
    elastic = spec(workers={"replicas": 2, "minReplicas": 1})
    r = step(step(the_spec=elastic).status, (worker(0), worker(1)), the_spec=elastic)
    recent = {"node-1": NodeView("node-1", ready=False, since=NOW - timedelta(seconds=30))}
    early = step(r.status, (worker(0), worker(1)), the_spec=elastic, nodes=recent)
    assert early.delete == [] and early.status.phase == "Running"
    old = {"node-1": NodeView("node-1", ready=False, since=NOW - timedelta(seconds=90))}
    late = step(r.status, (worker(0), worker(1, deleting=True)), the_spec=elastic, nodes=old)
    assert late.delete == [Delete("job-worker-1", "uid-0-1", force=True)]
    assert (late.status.failures, late.status.restarts, late.status.attempt) == (0, 1, 0)
    assert cond(late, "Restarting") == ("True", "WorkerReplaced")
    assert "NotReady node node-1" in late.events[0].message


def test_node_loss_with_too_few_survivors_restarts_the_gang_with_force_delete() -> None:
    r = running()
    nodes = {"node-0": NodeView("node-0", ready=False, since=NOW - timedelta(minutes=5))}
    d = step(r.status, (worker(0), worker(1)), nodes=nodes)
    assert d.status.attempt == 1
    assert Delete("job-worker-0", "uid-0-0", force=True) in d.delete
    assert Delete("job-worker-1", "uid-0-1", force=False) in d.delete


# ---- scheduling ------------------------------------------------------------------------------------------


def test_unschedulable_reported_after_timeout_only() -> None:
    job = spec(scheduling={"scheduleTimeoutSeconds": 60})
    created = step(the_spec=job)
    pending = (
        worker(
            0,
            phase="Pending",
            ready=False,
            unschedulable="0/3 nodes have enough nvidia.com/gpu",
            created=NOW - timedelta(seconds=10),
        ),
        worker(1, phase="Pending", ready=False, created=NOW - timedelta(seconds=10)),
    )
    early = step(created.status, pending, the_spec=job)
    assert cond(early, "Ready") == ("False", "WaitingForWorkers")
    late = step(early.status, pending, the_spec=job, now=NOW + timedelta(seconds=60))
    assert cond(late, "Ready") == ("False", "Unschedulable")
    assert cond(late, "Running") == ("False", "Unschedulable")
    assert "nvidia.com/gpu" in late.events[-1].message
    assert late.events[-1].reason == "Unschedulable"
    assert late.status.phase == "Created"
    later = step(late.status, pending, the_spec=job, now=NOW + timedelta(seconds=90))
    assert later.events == []  # reported once, not on every resync


def test_a_worker_that_cannot_start_is_named_in_ready_with_one_event() -> None:
    """A worker waits on a missing Secret (the pod's CreateContainerConfigError, read by observe_pod): Ready says
    so at once, with the kubelet's message, and one Warning event; then the Secret exists and the job runs."""
    from loom.operator.kinds.trainingjob.observe import observe_pod

    pod = {
        "metadata": {"name": "job-worker-1", "uid": "u1", "labels": {INDEX_LABEL: "1", ATTEMPT_LABEL: "0"}},
        "status": {"phase": "Pending", "containerStatuses": [{"name": "trainer", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "s3-credentials" not found'}}}]},
    }  # fmt: skip
    view = observe_pod(pod)
    assert view is not None and view.problem is not None and view.problem.reason == "CreateContainerConfigError"
    created = step()
    blocked = step(created.status, (worker(0), view))
    assert cond(blocked, "Ready") == ("False", "CreateContainerConfigError")
    ready = next(c for c in blocked.status.conditions if c.type == "Ready")
    expected = 'pod job-worker-1 container trainer: CreateContainerConfigError: secret "s3-credentials" not found'
    assert ready.message == expected
    assert [(e.type, e.reason) for e in blocked.events if e.reason == "CreateContainerConfigError"] == [
        ("Warning", "CreateContainerConfigError")
    ]
    again = step(blocked.status, (worker(0), view))
    assert [e for e in again.events if e.reason == "CreateContainerConfigError"] == []
    fixed = step(again.status, (worker(0), worker(1)))
    assert cond(fixed, "Ready") == ("True", "WorkersRunning")


# ---- run policy ------------------------------------------------------------------------------------------


def test_suspend_stops_workers_gracefully_then_resume_starts_a_new_attempt() -> None:
    r = running()
    suspended_spec = spec(runPolicy={"suspend": True})
    s = step(r.status, (worker(0), worker(1)), the_spec=suspended_spec)
    assert s.status.phase == "Suspended"
    assert s.delete == [Delete("job-worker-0", "uid-0-0"), Delete("job-worker-1", "uid-0-1")]
    assert cond(s, "Suspended") == ("True", "Suspending")
    gone = step(s.status, (), the_spec=suspended_spec)
    assert cond(gone, "Suspended") == ("True", "Suspended")
    assert gone.create == []
    assert gone.status.workers is not None and gone.status.workers.desired == 0
    resumed = step(gone.status, (), now=NOW + timedelta(hours=1))
    assert resumed.status.attempt == 1
    assert resumed.create == [0, 1]
    assert resumed.status.start_time == "2026-03-01T13:00:00Z"
    assert cond(resumed, "Suspended")[0] == "False"
    assert (resumed.status.restarts, resumed.status.failures) == (0, 0)
    assert "Resumed" in [e.reason for e in resumed.events]


def test_suspend_during_restart_keeps_the_budget() -> None:
    r = running()
    restarting = step(r.status, (worker(0), worker(1, phase="Failed", exit_code=1)))
    assert restarting.status.phase == "Restarting"
    suspended_spec = spec(runPolicy={"suspend": True})
    s = step(restarting.status, (worker(0, deleting=True),), the_spec=suspended_spec)
    assert s.status.phase == "Suspended"
    assert s.delete == []  # already being deleted gracefully
    gone = step(s.status, (), the_spec=suspended_spec)
    resumed = step(gone.status, ())
    assert resumed.create == [0, 1]
    assert resumed.status.attempt == 2
    assert (resumed.status.restarts, resumed.status.failures) == (1, 1)


def test_worker_exit_during_suspend_is_not_a_failure() -> None:
    r = running()
    suspended_spec = spec(runPolicy={"suspend": True})
    s = step(
        r.status,
        (worker(0, phase="Failed", exit_code=143, disrupted=True), worker(1, deleting=True)),
        the_spec=suspended_spec,
    )
    assert s.status.failures == 0 and s.status.restarts == 0


def test_active_deadline_fails_the_job() -> None:
    job = spec(runPolicy={"activeDeadlineSeconds": 600})
    r = step(step(the_spec=job).status, (worker(0), worker(1)), the_spec=job)
    ok = step(r.status, (worker(0), worker(1)), the_spec=job, now=NOW + timedelta(seconds=599))
    assert ok.status.phase == "Running"
    late = step(r.status, (worker(0), worker(1)), the_spec=job, now=NOW + timedelta(seconds=600))
    assert late.status.phase == "Failed"
    assert cond(late, "Failed") == ("True", "DeadlineExceeded")
    assert len(late.delete) == 2


def test_ttl_after_finished_deletes_children_once() -> None:
    job = spec(runPolicy={"ttlSecondsAfterFinished": 300})
    r = step(step(the_spec=job).status, (worker(0), worker(1)), the_spec=job)
    pods = (worker(0, phase="Succeeded"), worker(1, phase="Succeeded"))
    done = step(r.status, pods, the_spec=job)
    assert not done.delete_children
    early = step(done.status, pods, the_spec=job, now=NOW + timedelta(seconds=299))
    assert not early.delete_children
    late = step(done.status, pods, the_spec=job, now=NOW + timedelta(seconds=300))
    assert late.delete_children and late.status.children_deleted
    assert late.status.phase == "Succeeded"
    again = step(late.status, (), the_spec=job, now=NOW + timedelta(seconds=400))
    assert not again.delete_children


# ---- progress and scaling --------------------------------------------------------------------------------


def test_progress_and_checkpoint_land_in_status() -> None:
    r = running()
    report = ProgressReport(
        step=40,
        total_steps=100,
        loss=1.25,
        samples_per_second=64.0,
        eta="1m00s",
        latest_checkpoint=CheckpointReport(uri="s3://b/ckpt/step-00000040", step=40),
    )
    d = step(r.status, (worker(0), worker(1)), progress=report)
    assert d.status.progress is not None
    assert (d.status.progress.step, d.status.progress.total_steps, d.status.progress.loss) == (40, 100, 1.25)
    assert d.status.checkpoint is not None
    assert (d.status.checkpoint.latest, d.status.checkpoint.step) == ("s3://b/ckpt/step-00000040", 40)
    assert d.status.checkpoint.time == "2026-03-01T12:00:00Z"
    # No fresh report (worker 0 restarting): the last known progress stays.
    kept = step(d.status, (worker(0), worker(1)))
    assert kept.status.progress == d.status.progress


CKPT = "s3://bkt/ckpt"


def restarted_gang(the_spec: TrainingJobSpec) -> Decision:
    """A job at step 55 with a checkpoint at step 40 whose worker 1 died: the new gang's pods are running."""
    r = running()
    at55 = ProgressReport(
        step=55, total_steps=120, loss=2.8, samples_per_second=60.0, eta="30s", phase="Running",
        latest_checkpoint=CheckpointReport(uri=f"{CKPT}/step-000000040", step=40),
    )  # fmt: skip
    d = step(r.status, (worker(0), worker(1)), the_spec=the_spec, progress=at55)
    lost = step(d.status, (worker(0), worker(1, phase="Failed", exit_code=137)), the_spec=the_spec)
    assert lost.status.phase == "Restarting" and lost.status.attempt == 1
    fresh = step(lost.status, (), the_spec=the_spec)
    assert fresh.create == [0, 1]
    return fresh


def test_progress_never_shows_step_0_while_a_restarted_trainer_resumes() -> None:
    with_ckpt = spec(checkpoint={"uri": CKPT})
    fresh = restarted_gang(with_ckpt)
    new_gang = (worker(0, attempt=1), worker(1, attempt=1))
    # The new rank 0 serves its progress before it restored anything: step 0, no loss.
    starting = ProgressReport(step=0, total_steps=120, phase="Starting")
    d = step(fresh.status, new_gang, the_spec=with_ckpt, progress=starting)
    assert d.status.progress is not None
    assert (d.status.progress.step, d.status.progress.total_steps, d.status.progress.loss) == (40, 120, 2.8)
    # Once restored the trainer names the checkpoint (still step 0 until its first step).
    restored = ProgressReport(
        step=0, total_steps=120, phase="Starting", latest_checkpoint=CheckpointReport(f"{CKPT}/step-000000040", 40)
    )
    d = step(d.status, new_gang, the_spec=with_ckpt, progress=restored)
    assert d.status.progress is not None and d.status.progress.step == 40
    resumed = ProgressReport(step=41, total_steps=120, loss=2.79, phase="Running")
    d = step(d.status, new_gang, the_spec=with_ckpt, progress=resumed)
    assert d.status.progress is not None
    assert (d.status.progress.step, d.status.progress.loss) == (41, 2.79)


def test_progress_goes_back_to_an_older_checkpoint_the_trainer_resumed_from_but_not_below() -> None:
    with_ckpt = spec(checkpoint={"uri": CKPT})
    fresh = restarted_gang(with_ckpt)
    older = ProgressReport(
        step=0, total_steps=120, phase="Starting", latest_checkpoint=CheckpointReport(f"{CKPT}/step-000000020", 20)
    )
    d = step(fresh.status, (worker(0, attempt=1), worker(1, attempt=1)), the_spec=with_ckpt, progress=older)
    assert d.status.progress is not None and d.status.progress.step == 20
    assert d.status.checkpoint is not None and d.status.checkpoint.step == 20


def test_resume_none_restarts_from_step_0_and_says_so() -> None:
    fresh_start = spec(checkpoint={"uri": CKPT, "resume": "none"})
    fresh = restarted_gang(fresh_start)
    starting = ProgressReport(step=0, total_steps=120, phase="Starting")
    d = step(fresh.status, (worker(0, attempt=1), worker(1, attempt=1)), the_spec=fresh_start, progress=starting)
    assert d.status.progress is not None and d.status.progress.step == 0


def test_restarting_lasts_until_the_trainer_runs_steps_again() -> None:
    with_ckpt = spec(checkpoint={"uri": CKPT})
    fresh = restarted_gang(with_ckpt)
    new_gang = (worker(0, attempt=1), worker(1, attempt=1))
    # Pods running, the trainer's endpoint not up yet: the job is still restarting.
    d = step(fresh.status, new_gang, the_spec=with_ckpt)
    assert d.status.phase == "Restarting"
    assert cond(d, "Restarting") == ("True", "GangRestart")
    assert cond(d, "Ready")[0] == "False"
    assert "waiting for the trainer to resume from step 40" in next(
        c.message for c in d.status.conditions if c.type == "Restarting"
    )
    d = step(d.status, new_gang, the_spec=with_ckpt, progress=ProgressReport(step=0, phase="Starting"))
    assert d.status.phase == "Restarting"
    assert "Recovered" not in [e.reason for e in d.events]
    d = step(d.status, new_gang, the_spec=with_ckpt, progress=ProgressReport(step=41, phase="Running"))
    assert d.status.phase == "Running"
    assert cond(d, "Restarting")[0] == "False" and cond(d, "Ready")[0] == "True"
    assert "Recovered" in [e.reason for e in d.events]


def test_restarting_without_a_trainer_phase_ends_once_a_step_past_the_checkpoint_is_reported() -> None:
    with_ckpt = spec(checkpoint={"uri": CKPT})
    fresh = restarted_gang(with_ckpt)
    new_gang = (worker(0, attempt=1), worker(1, attempt=1))
    # Prometheus gauges: no phase, the checkpoint gauge says where it resumed.
    at = CheckpointReport(f"{CKPT}/step-000000040", 40)
    d = step(fresh.status, new_gang, the_spec=with_ckpt, progress=ProgressReport(step=40, latest_checkpoint=at))
    assert d.status.phase == "Restarting"
    d = step(d.status, new_gang, the_spec=with_ckpt, progress=ProgressReport(step=42, latest_checkpoint=at))
    assert d.status.phase == "Running"


def test_restarting_waits_for_a_silent_trainer_only_up_to_the_resume_timeout() -> None:
    with_ckpt = spec(checkpoint={"uri": CKPT})
    fresh = restarted_gang(with_ckpt)
    new_gang = (worker(0, attempt=1), worker(1, attempt=1))
    d = step(fresh.status, new_gang, the_spec=with_ckpt, now=NOW + timedelta(seconds=599))
    assert d.status.phase == "Restarting"
    d = step(d.status, new_gang, the_spec=with_ckpt, now=NOW + timedelta(seconds=600))
    assert d.status.phase == "Running"


def test_scale_down_deletes_extra_workers_without_restart() -> None:
    r = running()
    d = step(r.status, (worker(0), worker(1)), the_spec=spec(workers={"replicas": 1}))
    assert d.delete == [Delete("job-worker-1", "uid-0-1")]
    assert d.status.restarts == 0 and d.status.attempt == 0


def test_scale_up_creates_the_new_worker() -> None:
    r = running()
    d = step(r.status, (worker(0), worker(1)), the_spec=spec(workers={"replicas": 3, "maxReplicas": 3}))
    assert d.create == [2]
    assert d.status.restarts == 0


def test_stale_worker_from_an_operator_crash_is_cleaned_up_before_create() -> None:
    # Status says attempt 1 (written before the crash) but an attempt-0 pod survived.
    status = TrainingJobStatus(phase="Restarting", attempt=1, restarts=1, failures=1)
    d = step(status, (worker(0, attempt=0),))
    assert d.delete == [Delete("job-worker-0", "uid-0-0")]
    assert d.create == []


def test_status_patch_nulls_cleared_fields_and_skips_no_ops() -> None:
    r = running()
    old = r.status.to_wire()
    assert status_patch(old, old) is None
    suspended = step(r.status, (), the_spec=spec(runPolicy={"suspend": True}))
    resumed = step(suspended.status, ())
    patch = status_patch(suspended.status.to_wire(), resumed.status.to_wire())
    assert patch is not None
    assert patch["attempt"] == 1
    assert patch["startTime"] == "2026-03-01T12:00:00Z"
    cleared = status_patch({"phase": "Running", "startTime": "x"}, {"phase": "Suspended"})
    assert cleared == {"phase": "Suspended", "startTime": None}


def test_status_patch_nulls_fields_cleared_inside_nested_objects() -> None:
    """A merge patch keeps what it leaves out of a nested object: a field cleared there must be sent as null."""
    old = {"rollout": {"analysis": {"step": "1/2", "stepStartedAt": "t1", "lastEvaluatedAt": "t2"}, "x": [1, 2]}}
    new = {"rollout": {"analysis": {"step": "2/2"}, "x": [1]}}
    patch = status_patch(old, new)
    assert patch == {"rollout": {"analysis": {"step": "2/2", "stepStartedAt": None, "lastEvaluatedAt": None},
                                 "x": [1]}}
    assert _apply_merge_patch(old, patch) == new


def _apply_merge_patch(target: object, patch: object) -> object:
    """RFC 7386, as the API server applies a merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _apply_merge_patch(result.get(key), value)
    return result
