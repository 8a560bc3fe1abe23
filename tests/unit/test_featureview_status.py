"""FeatureView status: Jobs' termination messages become conditions; Ready needs registration and a server."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from loom.operator.kinds.featureview.api import FeatureViewStatus
from loom.operator.kinds.featureview.config import Rejection
from loom.operator.kinds.featureview.status import JobResult, Observed, compute_status, job_result, newest, next_run

NOW = datetime(2026, 1, 3, 10, 20, tzinfo=UTC)


def job(name: str, *, state: str = "Running", created: str = "2026-01-03T10:00:00Z") -> dict[str, Any]:
    status: dict[str, Any] = {}
    if state == "Running":
        status["active"] = 1
    elif state == "Succeeded":
        status = {
            "succeeded": 1,
            "completionTime": "2026-01-03T10:05:00Z",
            "conditions": [{"type": "Complete", "status": "True"}],
        }
    elif state == "Failed":
        status = {
            "failed": 1,
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "PodFailurePolicy",
                    "message": "exit 3",
                    "lastTransitionTime": "2026-01-03T10:06:00Z",
                }
            ],
        }
    return {"metadata": {"name": name, "creationTimestamp": created}, "status": status}


def pod(message: dict[str, Any] | str, exit_code: int, created: str = "2026-01-03T10:00:01Z") -> dict[str, Any]:
    text = message if isinstance(message, str) else json.dumps(message)
    return {
        "metadata": {"creationTimestamp": created},
        "status": {
            "containerStatuses": [{"name": "feast", "state": {"terminated": {"exitCode": exit_code, "message": text}}}]
        },
    }


def observed(**overrides: Any) -> Observed:
    base: dict[str, Any] = {
        "generation": 2,
        "project": "rides",
        "registry": "/var/lib/loom/features/registry.db",
        "online_store": "sqlite",
        "url": "http://rides-features.ns.svc",
        "schedule": "0 * * * *",
        "server_replicas": 1,
        "server_ready": 1,
    }
    base.update(overrides)
    return Observed(**base)


def cond(status: FeatureViewStatus, ctype: str) -> tuple[str, str, str]:
    c = next(c for c in status.conditions if c.type == ctype)
    return c.status, c.reason, c.message


APPLIED = {
    "exitCode": 0,
    "command": "apply",
    "outcome": "Applied",
    "registry": "/r.db",
    "featureViews": [{"name": "v", "changed": True, "changes": ["ttl"]}],
}


def test_job_result_reads_the_termination_message() -> None:
    ok = job_result(job("a", state="Succeeded"), [pod(APPLIED, 0)])
    assert ok.state == "Succeeded" and ok.result["outcome"] == "Applied" and ok.exit_code == 0
    feast_error = {"exitCode": 3, "reason": "InvalidSource", "message": "column 'event_timestamp' not in source"}
    bad = job_result(job("b", state="Failed"), [pod(feast_error, 3)])
    assert (bad.state, bad.reason, bad.message, bad.exit_code) == (
        "Failed",
        "InvalidSource",
        "column 'event_timestamp' not in source",
        3,
    )
    crashed = job_result(job("c", state="Failed"), [pod("Traceback: boom", 1)])
    assert (crashed.reason, crashed.message) == ("PodFailurePolicy", "Traceback: boom")
    assert job_result(job("d"), []).state == "Running"
    assert job_result({"metadata": {"name": "e"}, "status": {}}, []).state == "Pending"


def test_newest_pod_wins() -> None:
    older = pod({"exitCode": 1, "reason": "Failed", "message": "old"}, 1, "2026-01-03T10:00:01Z")
    newer = pod({"exitCode": 2, "reason": "InvalidConfig", "message": "new"}, 2, "2026-01-03T10:01:01Z")
    assert job_result(job("a", state="Failed"), [older, newer]).message == "new"


def test_registered_and_ready() -> None:
    applied = JobResult("v-apply-1", "Succeeded", result=APPLIED)
    status, events = compute_status(observed(apply=applied), None, NOW)
    assert cond(status, "Registered")[:2] == ("True", "Applied")
    assert "ttl" in cond(status, "Registered")[2]
    assert cond(status, "Ready")[0] == "True"
    assert status.phase == "Ready" and status.registered
    assert (status.project, status.online_store, status.url) == ("rides", "sqlite", "http://rides-features.ns.svc")
    assert {e.reason for e in events} == {"Registered", "Ready"}
    assert all(c.observed_generation == 2 for c in status.conditions)
    again, events = compute_status(observed(apply=applied), status, NOW)
    assert events == [] and again == status


def test_not_ready_without_a_server_answering() -> None:
    applied = JobResult("v-apply-1", "Succeeded", result=APPLIED)
    status, _ = compute_status(observed(apply=applied, server_ready=0), None, NOW)
    assert cond(status, "ServerReady")[:2] == ("False", "ServerStarting")
    assert cond(status, "Ready")[:2] == ("False", "ServerStarting")
    assert status.phase == "Registered"


def test_feast_refusal_is_a_condition_with_feasts_message() -> None:
    failed = JobResult(
        "v-apply-1",
        "Failed",
        exit_code=3,
        reason="InvalidSource",
        message="source s3://b/x.parquet lacks timestamp column 'ts'",
    )
    status, events = compute_status(observed(apply=failed), None, NOW)
    assert cond(status, "Registered") == (
        "False",
        "InvalidSource",
        "source s3://b/x.parquet lacks timestamp column 'ts'",
    )
    assert cond(status, "Ready")[:2] == ("False", "InvalidSource")
    assert status.phase == "Failed" and not status.registered
    assert [(e.type, e.reason) for e in events] == [("Warning", "InvalidSource")]


def test_rejected_view_and_waiting_writer() -> None:
    status, _ = compute_status(observed(rejection=Rejection("StoreConflict", "use the same store")), None, NOW)
    assert cond(status, "Registered") == ("False", "StoreConflict", "use the same store")
    status, _ = compute_status(observed(waiting_for_writer=True), None, NOW)
    assert cond(status, "Registered")[:2] == ("Unknown", "WaitingForWriter")
    assert status.phase == "Pending"


def test_reapplying_keeps_registered() -> None:
    applied = JobResult("v-apply-1", "Succeeded", result=APPLIED)
    first, _ = compute_status(observed(apply=applied), None, NOW)
    second, _ = compute_status(observed(apply=JobResult("v-apply-2", "Running")), first, NOW)
    assert cond(second, "Registered")[:2] == ("Unknown", "Applying")
    assert second.registered


def test_materialization_window_rows_and_next_run() -> None:
    applied = JobResult("v-apply-1", "Succeeded", result=APPLIED)
    status, _ = compute_status(observed(apply=applied), None, NOW)
    assert cond(status, "Materialized")[:2] == ("Unknown", "NotYetMaterialized")
    assert status.next_materialization == "2026-01-03T11:00:00Z"
    done = JobResult(
        "v-mat-abc",
        "Succeeded",
        completed="2026-01-03T10:10:00Z",
        result={
            "exitCode": 0,
            "outcome": "Succeeded",
            "rowsWritten": 5,
            "window": {"start": "2026-01-02T10:10:00Z", "end": "2026-01-03T10:10:00Z"},
        },
    )
    status2, events = compute_status(observed(apply=applied, materialization=done), status, NOW)
    last = status2.last_materialization
    assert last is not None
    assert (last.start, last.end, last.rows_written, last.outcome, last.job) == (
        "2026-01-02T10:10:00Z",
        "2026-01-03T10:10:00Z",
        5,
        "Succeeded",
        "v-mat-abc",
    )
    assert cond(status2, "Materialized")[:2] == ("True", "Materialized")
    assert [e.reason for e in events] == ["Materialized"]
    # The next run keeps the last finished window on show; its failure is announced once.
    running, _ = compute_status(observed(apply=applied, materialization=JobResult("v-mat-2", "Running")), status2, NOW)
    assert running.last_materialization == last and running.phase == "Ready"
    failed = JobResult("v-mat-2", "Failed", reason="Failed", message="redis unreachable")
    status3, events = compute_status(observed(apply=applied, materialization=failed), running, NOW)
    assert cond(status3, "Materialized") == ("False", "MaterializationFailed", "redis unreachable")
    assert [e.reason for e in events] == ["MaterializationFailed"]


def test_suspended_or_offline_has_no_next_run() -> None:
    status, _ = compute_status(observed(suspended=True), None, NOW)
    assert status.next_materialization is None
    status, _ = compute_status(observed(online=False), None, NOW)
    assert cond(status, "Materialized")[:2] == ("False", "NotOnline")


def test_cron_helpers() -> None:
    assert next_run("@daily", NOW) == datetime(2026, 1, 4)
    assert next_run("not a cron", NOW) is None
    a = JobResult("a", "Succeeded", created="2026-01-03T09:00:00Z")
    b = JobResult("b", "Running", created="2026-01-03T10:00:00Z")
    assert newest([a, b]) == b and newest([]) is None


def test_status_names_the_view_as_feast_knows_it_and_the_feature_references_to_look_up() -> None:
    """driver-stats is driver_stats in Feast: `driver-stats:conv_rate` answers 404, the status says what works."""
    from loom.operator.kinds.featureview.config import feature_refs

    refs = feature_refs("driver-stats", ["conv_rate", "acc_rate"])
    assert refs == ["driver_stats:conv_rate", "driver_stats:acc_rate"]
    applied = JobResult("v-apply-1", "Succeeded", result=APPLIED)
    status, _ = compute_status(observed(apply=applied, feast_view="driver_stats", feature_refs=tuple(refs)), None, NOW)
    assert status.feast_view == "driver_stats" and status.feature_refs == refs
    dumped = status.model_dump(by_alias=True, exclude_none=True)
    assert dumped["feastView"] == "driver_stats"
    assert dumped["featureRefs"] == ["driver_stats:conv_rate", "driver_stats:acc_rate"]
    assert "as driver_stats" in cond(status, "Ready")[2]


def test_pods_that_cannot_start_are_named_instead_of_applying_and_starting() -> None:
    """The apply Job's pod and the feature server's pods wait on a missing Secret: Registered, ServerReady and Ready
    say so with the kubelet's message, and one Warning event per cause (not one per pass)."""
    from loom.operator.core.pod_problems import PodProblem

    missing = 'secret "redis-connection" not found'
    apply_pod = PodProblem("CreateContainerConfigError", "driver-stats-apply-1-x", "feast", missing)
    server_pod = PodProblem("CreateContainerConfigError", "rides-features-abc", "feast", missing)
    running = JobResult("driver-stats-apply-1", "Running")
    stuck = observed(
        apply=running, server_ready=0, server_replicas=2, apply_problem=apply_pod, server_problem=server_pod
    )
    status, events = compute_status(stuck, None, NOW)
    registered, server, ready = cond(status, "Registered"), cond(status, "ServerReady"), cond(status, "Ready")
    assert registered[:2] == ("Unknown", "CreateContainerConfigError") and missing in registered[2]
    assert "driver-stats-apply-1-x" in registered[2] and "Job driver-stats-apply-1" in registered[2]
    assert server[:2] == ("False", "CreateContainerConfigError") and "rides-features-abc" in server[2]
    assert server[2].startswith("0/2 feature server replicas ready: ")
    assert ready[:2] == ("False", "CreateContainerConfigError") and missing in ready[2]
    warned = [(e.type, e.reason) for e in events if e.reason == "CreateContainerConfigError"]
    assert warned == [("Warning", "CreateContainerConfigError")] * 2
    again, events = compute_status(stuck, status, NOW)
    assert [e for e in events if e.reason == "CreateContainerConfigError"] == []  # the same cause: no new event
    # The Secret created: the pods start, the view is applied and served.
    fixed, _ = compute_status(
        observed(apply=JobResult("driver-stats-apply-1", "Succeeded", result=APPLIED)), again, NOW
    )
    assert cond(fixed, "Ready")[0] == "True"
    # Without a problem it still says what it does.
    plain, _ = compute_status(observed(apply=running, server_ready=0), None, NOW)
    assert cond(plain, "Registered")[1] == "Applying" and cond(plain, "ServerReady")[1] == "ServerStarting"
