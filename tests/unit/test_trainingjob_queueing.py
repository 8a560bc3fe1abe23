"""A TrainingJob queued by Kueue: its Workload (pod sets, GPUs, partial admission) and the admission and eviction
state machine (held until admitted, flavor placement, eviction -> final checkpoint -> requeue -> resume), pure."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from loom.operator.core.queue import workload as kueue
from loom.operator.core.queue.job import QueueObservation
from loom.operator.kinds.trainingjob import render
from loom.operator.kinds.trainingjob.api import CheckpointStatus, TrainingJobSpec, TrainingJobStatus
from loom.operator.kinds.trainingjob.decision import Decision, Observation, Policy
from loom.operator.kinds.trainingjob.queue.workload import workload
from loom.operator.kinds.trainingjob.state import decide
from loom.workloads.trainer.config import EXIT_INTERRUPTED

from .test_trainingjob_state import NOW, cond, worker

JOB = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "llm", "namespace": "team-a", "uid": "u-1", "labels": {kueue.QUEUE_LABEL: "team-a"}},
}


def spec(**workers: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "engine": "fsdp",
            "entrypoint": {"module": "m:task"},
            "workers": {"replicas": 2, "gpusPerWorker": 8, **workers},
            "checkpoint": {"uri": "s3://ckpt/llm", "endpoint": "http://s3:9000"},
        }
    )


def rendered(the_spec: TrainingJobSpec, priority: kueue.Priority | None = None) -> dict[str, Any]:
    pod = render.worker_pod(JOB, the_spec, 0, attempt=0, image="registry.example/trainer:1", mlflow_run_id=None)
    return workload(JOB, the_spec, pod, "team-a", priority)


# ---- the Workload ------------------------------------------------------------------------------------------


def test_workload_has_one_pod_set_of_all_workers_with_their_gpus() -> None:
    wl = rendered(spec(resources={"requests": {"cpu": "4", "memory": "32Gi"}}))
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["spec"]["queueName"] == "team-a"
    [pod_set] = wl["spec"]["podSets"]
    assert pod_set["name"] == "workers" and pod_set["count"] == 2
    assert "minCount" not in pod_set  # not elastic: all or nothing
    [container] = pod_set["template"]["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "8"}}
    # An accounting record: no env, volumes or commands leak into it.
    assert set(container) == {"name", "image", "resources"}
    assert set(pod_set["template"]["spec"]) == {"containers"}


def test_workload_is_owned_by_the_job_and_named_per_incarnation() -> None:
    wl = rendered(spec())
    meta = wl["metadata"]
    assert meta["namespace"] == "team-a"
    assert meta["ownerReferences"][0]["kind"] == "TrainingJob" and meta["ownerReferences"][0]["controller"] is True
    assert meta["labels"][kueue.JOB_UID_LABEL] == "u-1"
    assert meta["name"] == kueue.workload_name("TrainingJob", "llm", "u-1")
    assert meta["name"].startswith("trainingjob-llm-")
    assert kueue.workload_name("TrainingJob", "llm", "u-2") != meta["name"]
    long = kueue.workload_name("TrainingJob", "x" * 60, "u-1")
    assert len(long) == 63 and long.startswith("trainingjob-xxx")


def test_elastic_minimum_is_partial_admission() -> None:
    [pod_set] = rendered(spec(replicas=4, minReplicas=2, maxReplicas=4))["spec"]["podSets"]
    assert pod_set["count"] == 4 and pod_set["minCount"] == 2


def test_selector_tolerations_and_priority_reach_the_workload() -> None:
    the_spec = spec(nodeSelector={"gpu": "a100"}, tolerations=[{"key": "gpu", "operator": "Exists"}])
    wl = rendered(the_spec, kueue.Priority("WorkloadPriorityClass", "high", 1000))
    template = wl["spec"]["podSets"][0]["template"]["spec"]
    assert template["nodeSelector"] == {"gpu": "a100"}
    assert template["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "high",
    }


def test_queue_name_comes_from_kueues_label() -> None:
    assert kueue.queue_name(JOB["metadata"]) == "team-a"
    assert kueue.queue_name({"name": "x"}) is None


def test_flavor_placement_adds_node_labels_and_tolerations() -> None:
    pod = render.worker_pod(JOB, spec(nodeSelector={"zone": "a"}), 0, attempt=0, image="i", mlflow_run_id=None)
    flavor = kueue.FlavorView("a100", {"gpu.vendor/model": "a100"}, ({"key": "gpu", "operator": "Exists"},))
    placed = kueue.place(pod, [flavor])
    assert placed["spec"]["nodeSelector"] == {"gpu.vendor/model": "a100", "zone": "a"}
    assert {"key": "gpu", "operator": "Exists"} in placed["spec"]["tolerations"]
    assert pod["spec"].get("tolerations") is None  # the input is not modified


# ---- Workload views and the status writes Kueue expects ----------------------------------------------------


def wl_body(
    *, admitted: bool = False, count: int | None = None, evicted: str | None = None, waiting: str = ""
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    status: dict[str, Any] = {"conditions": conditions}
    if admitted or evicted:
        assignment: dict[str, Any] = {"name": "workers", "flavors": {"nvidia.com/gpu": "gpu", "cpu": "default"}}
        if count is not None:
            assignment["count"] = count
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [assignment]}
        conditions.append({"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": ""})
        conditions.append({"type": "Admitted", "status": "True", "reason": "Admitted", "message": ""})
    else:
        conditions.append({"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": waiting})
    if evicted:
        conditions.append(
            {
                "type": "Evicted",
                "status": "True",
                "reason": evicted,
                "message": "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue",
                "lastTransitionTime": "2026-03-01T12:00:00Z",
            }
        )
    return {"metadata": {"name": "trainingjob-llm-abcde", "uid": "w-1", "resourceVersion": "7"}, "status": status}


def test_observe_workload_reads_admission_eviction_and_why_it_waits() -> None:
    waiting = kueue.observe_workload(wl_body(waiting="insufficient unused quota for nvidia.com/gpu, 8 more needed"))
    assert not waiting.admitted and waiting.eviction is None
    assert waiting.waiting == "insufficient unused quota for nvidia.com/gpu, 8 more needed"
    admitted = kueue.observe_workload(wl_body(admitted=True, count=1))
    assert admitted.admitted and admitted.cluster_queue == "cq"
    assert admitted.assignment("workers") == kueue.Assignment("workers", 1, {"nvidia.com/gpu": "gpu", "cpu": "default"})
    assert kueue.describe_flavors(admitted.assignments) == "default,gpu"
    evicted = kueue.observe_workload(wl_body(admitted=True, evicted="Preempted"))
    assert evicted.eviction is not None and evicted.eviction.reason == "Preempted"
    assert evicted.eviction.since == NOW


def test_release_clears_admission_and_requeues_guarded_by_resource_version() -> None:
    view = kueue.observe_workload(wl_body(admitted=True, evicted="Preempted"))
    patch = kueue.release(view, NOW + timedelta(seconds=30))
    assert patch["metadata"] == {"resourceVersion": "7"}
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False" and by_type["QuotaReserved"]["reason"] == "Pending"
    assert by_type["Admitted"]["status"] == "False"
    assert by_type["Requeued"]["status"] == "True" and by_type["Requeued"]["reason"] == "Preempted"
    assert by_type["Evicted"]["status"] == "True"  # Kueue clears its own condition when it admits again
    # A waitForPodsReady timeout: Kueue decides when it requeues (its backoff), not the job controller.
    timed_out = kueue.observe_workload(wl_body(admitted=True, evicted="PodsReadyTimeout"))
    requeued = {c["type"]: c for c in kueue.release(timed_out, NOW)["status"]["conditions"]}["Requeued"]
    assert requeued["status"] == "False"


def test_finish_marks_the_workload_finished() -> None:
    view = kueue.observe_workload(wl_body(admitted=True))
    patch = kueue.finish(view, True, "all 2 workers exited 0", NOW)
    finished = {c["type"]: c for c in patch["status"]["conditions"]}["Finished"]
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    assert kueue.finish(view, False, "x", NOW)["status"]["conditions"][-1]["reason"] == "Failed"


# ---- the state machine -------------------------------------------------------------------------------------


def queue(body: dict[str, Any] | None, **flavors: kueue.FlavorView) -> QueueObservation:
    return QueueObservation("team-a", kueue.observe_workload(body) if body is not None else None, dict(flavors))


def step(
    q: QueueObservation,
    status: TrainingJobStatus | None = None,
    pods: tuple[Any, ...] = (),
    the_spec: TrainingJobSpec | None = None,
    now: datetime = NOW,
) -> Decision:
    return decide(
        Observation(
            generation=1, spec=the_spec or spec(), status=status or TrainingJobStatus(), pods=pods, now=now, queue=q
        ),
        Policy(eviction_timeout_seconds=150),
    )


def test_a_queued_job_has_no_workers_until_admitted() -> None:
    d = step(queue(None))
    assert d.create_workload and d.create == []
    assert d.status.phase == "Queued"
    assert d.status.queue is not None and d.status.queue.state == "Queued" and d.status.queue.name == "team-a"
    assert cond(d, "Admitted") == ("False", "Queued")
    assert cond(d, "Created")[0] == "False"
    assert [e.reason for e in d.events] == ["Queued"]
    waiting = step(queue(wl_body(waiting="insufficient unused quota for nvidia.com/gpu")), d.status)
    assert waiting.create == [] and not waiting.create_workload
    assert waiting.status.queue is not None
    assert waiting.status.queue.message == "insufficient unused quota for nvidia.com/gpu"
    assert waiting.events == []  # the Queued event is said once


def test_a_waiting_job_shows_its_queue_position_while_kueue_reports_one() -> None:
    waiting = wl_body(waiting="insufficient unused quota")
    here = kueue.Position(cluster_queue=3, local_queue=1)
    d = step(QueueObservation("team-a", kueue.observe_workload(waiting), {}, here))
    assert d.status.queue is not None and d.status.queue.position == 3
    unknown = step(queue(waiting), d.status)  # the visibility API stopped answering: no stale position
    assert unknown.status.queue is not None and unknown.status.queue.position is None
    admitted = step(QueueObservation("team-a", kueue.observe_workload(wl_body(admitted=True)), {}, here), d.status)
    assert admitted.status.queue is not None and admitted.status.queue.position is None


def test_admission_starts_the_workers_and_reports_the_flavor() -> None:
    queued = step(queue(None))
    d = step(queue(wl_body(admitted=True)), queued.status)
    assert d.create == [0, 1] and d.status.phase == "Created"
    assert d.status.queue is not None
    assert (d.status.queue.state, d.status.queue.cluster_queue, d.status.queue.flavor) == (
        "Admitted",
        "cq",
        "default,gpu",
    )
    assert cond(d, "Admitted") == ("True", "Admitted")
    assert [e.reason for e in d.events] == ["Admitted", "Created"]


def test_partial_admission_starts_as_many_workers_as_admitted() -> None:
    elastic = spec(replicas=4, minReplicas=2, maxReplicas=4)
    d = step(queue(wl_body(admitted=True, count=2)), step(queue(None), the_spec=elastic).status, the_spec=elastic)
    assert d.create == [0, 1]
    assert d.status.queue is not None and d.status.queue.admitted_workers == 2
    assert "2 of 4 worker(s)" in d.events[0].message


def evicting(status: TrainingJobStatus, pods: tuple[Any, ...], now: datetime = NOW) -> Decision:
    return step(queue(wl_body(admitted=True, evicted="Preempted")), status, pods, now=now)


def admitted_and_running() -> TrainingJobStatus:
    queued = step(queue(None))
    created = step(queue(wl_body(admitted=True)), queued.status)
    running = step(queue(wl_body(admitted=True)), created.status, (worker(0), worker(1)))
    assert running.status.phase == "Running"
    return running.status


def test_eviction_stops_workers_gracefully_for_their_final_checkpoint() -> None:
    status = admitted_and_running()
    d = evicting(status, (worker(0), worker(1)))
    assert [(x.name, x.force) for x in d.delete] == [("job-worker-0", False), ("job-worker-1", False)]
    assert not d.release_workload  # not before every worker stopped
    assert d.status.phase == "Queued" and d.status.queue is not None and d.status.queue.state == "Evicting"
    assert d.status.queue.evictions == 1
    assert d.status.queue.last_eviction is not None and d.status.queue.last_eviction.reason == "Preempted"
    assert [e.reason for e in d.events] == ["Evicted"]
    assert d.status.restarts == 0 and d.status.failures == 0


def test_eviction_waits_within_a_bound_then_forces() -> None:
    status = evicting(admitted_and_running(), (worker(0), worker(1))).status
    stopping = (worker(0, deleting=True), worker(1, deleting=True))
    d = evicting(status, stopping, now=NOW + timedelta(seconds=60))
    assert d.delete == [] and not d.release_workload  # graceful deletes already asked; waiting
    late = evicting(d.status, stopping, now=NOW + timedelta(seconds=151))
    assert [(x.name, x.force) for x in late.delete] == [("job-worker-0", True), ("job-worker-1", True)]
    assert late.status.queue is not None and late.status.queue.last_eviction is not None
    assert late.status.queue.last_eviction.checkpointed is False
    assert late.status.queue.evictions == 1  # one eviction, however many passes


def test_requeue_after_the_final_checkpoint_and_resume_on_readmission() -> None:
    status = admitted_and_running()
    status.checkpoint = CheckpointStatus(latest="s3://ckpt/llm/step-000000040", step=40)
    d = evicting(status, (worker(0), worker(1)))
    exited = (
        worker(0, phase="Failed", exit_code=EXIT_INTERRUPTED, disrupted=True, deleting=True),
        worker(1, phase="Failed", exit_code=EXIT_INTERRUPTED, disrupted=True, deleting=True),
    )
    # Exited (143: after the final checkpoint): nothing runs any more, the quota goes back, even before the pod
    # objects are gone.
    gone = evicting(d.status, exited, now=NOW + timedelta(seconds=25))
    assert gone.release_workload and gone.status.phase == "Queued" and gone.delete == []
    assert gone.status.attempt == status.attempt + 1  # the next gang starts from the checkpoint
    assert gone.status.queue is not None and gone.status.queue.last_eviction is not None
    assert gone.status.queue.last_eviction.checkpointed is True
    assert gone.status.queue.last_eviction.stopped_time == "2026-03-01T12:00:25Z"
    assert [e.reason for e in gone.events] == ["Requeued"]
    assert "after their final checkpoint" in gone.events[0].message
    assert gone.events[0].message.endswith("resumes from step 40")
    assert gone.status.queue.last_eviction.checkpoint_step == 40
    assert gone.status.restarts == 0 and gone.status.failures == 0
    # Kueue took the quota back (no admission; Evicted stays until it admits again): still Queued, no new event.
    requeued = kueue.observe_workload(wl_body(waiting="Preempted"))
    waiting = step(QueueObservation("team-a", requeued), gone.status)
    assert waiting.status.phase == "Queued" and waiting.create == [] and not waiting.release_workload
    assert waiting.events == []
    back = step(queue(wl_body(admitted=True)), waiting.status)
    assert back.create == [0, 1] and back.status.phase == "Created"
    assert back.status.queue is not None and back.status.queue.evictions == 1
    assert back.status.restarts == 0


def test_a_release_that_did_not_land_is_repeated_without_counting_again() -> None:
    status = evicting(admitted_and_running(), (worker(0), worker(1))).status
    first = evicting(status, ())
    again = evicting(first.status, ())
    assert again.release_workload and again.status.attempt == first.status.attempt and again.events == []


def test_admission_lost_without_eviction_stops_the_workers() -> None:
    status = admitted_and_running()
    d = step(queue(wl_body()), status, (worker(0), worker(1)))
    assert len(d.delete) == 2 and d.status.phase == "Queued"


def test_finishing_marks_the_workload_finished() -> None:
    status = admitted_and_running()
    done = (worker(0, phase="Succeeded"), worker(1, phase="Succeeded"))
    d = step(queue(wl_body(admitted=True)), status, done)
    assert d.status.phase == "Succeeded" and d.finish_workload
    assert d.status.queue is not None and d.status.queue.state == "Finished"
    body = wl_body(admitted=True)
    body["status"]["conditions"].append({"type": "Finished", "status": "True", "reason": "Succeeded"})
    later = step(queue(body), d.status, ())
    assert not later.finish_workload  # said once Kueue shows it


def test_without_the_label_nothing_changes() -> None:
    d = decide(Observation(generation=1, spec=spec(), status=TrainingJobStatus(), pods=(), now=NOW), Policy())
    assert d.create == [0, 1] and d.status.queue is None and not d.create_workload
    assert all(c.type != "Admitted" for c in d.status.conditions)
