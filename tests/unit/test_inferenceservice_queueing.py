"""An InferenceService queued by Kueue: its Workloads (the minimum as one pod set, one Workload per scale step pinned
to the minimum's flavor) and the admission decisions (held until admitted, scale steps asked for and deleted,
evictions scaled away before the quota is released, what waits reported), pure."""

from __future__ import annotations

from typing import Any

from loom.operator.core.queue import workload as kueue
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec, InferenceServiceStatus
from loom.operator.kinds.inferenceservice.queue.admission import (
    STEP_LABEL,
    ServiceQueue,
    admit,
    minimum,
    observe,
    report_status,
    workloads,
)
from loom.operator.kinds.inferenceservice.render import render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model

OWNER = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1},
}
BASE = kueue.workload_name("InferenceService", "chat", "uid-1")
GPU = kueue.FlavorView("gpu-a100", {"gpu": "a100"}, ({"key": "nvidia.com/gpu", "operator": "Exists"},))


def spec(**extra: Any) -> InferenceServiceSpec:
    model = {"uri": "s3://models/chat", "endpoint": "http://s3:9000"}
    wire = {"model": model, "handler": "chargpt", "gpus": 1, **extra}
    return InferenceServiceSpec.model_validate(wire)


def autoscaled(low: int = 2, high: int = 6, replicas: int | None = None) -> InferenceServiceSpec:
    extra: dict[str, Any] = {"autoscaling": {"minReplicas": low, "maxReplicas": high, "target": 60}}
    if replicas is not None:
        extra["replicas"] = replicas
    return spec(**extra)


def pod(the_spec: InferenceServiceSpec) -> dict[str, Any]:
    ref = resolve_model(the_spec.model, the_spec.handler)
    _, deployment = render_deployment(OWNER, the_spec, "stable", ref, 1, "loom/server:test")
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


def wl(
    name: str = BASE,
    *,
    admitted: bool = False,
    evicted: str | None = None,
    reserved: bool | None = None,
    waiting: str = "",
    step: int | None = None,
    count: int = 2,
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    status: dict[str, Any] = {"conditions": conditions}
    if admitted or (evicted and reserved is not False):
        flavors = {"nvidia.com/gpu": "gpu-a100", "cpu": "gpu-a100"}
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [{"name": "replicas", "flavors": flavors}]}
        conditions.append({"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": ""})
        conditions.append({"type": "Admitted", "status": "True", "reason": "Admitted", "message": ""})
    else:
        conditions.append({"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": waiting})
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": evicted, "message": "to make room"})
    labels = {kueue.JOB_UID_LABEL: "uid-1", **({STEP_LABEL: str(step)} if step is not None else {})}
    meta = {"name": name, "uid": f"w-{name}", "resourceVersion": "5", "labels": labels}
    return {"metadata": meta, "spec": {"podSets": [{"name": "replicas", "count": count}]}, "status": status}


def step_wl(k: int, **kw: Any) -> dict[str, Any]:
    return wl(kueue.workload_name("InferenceService", "chat", "uid-1", f"s{k}"), step=k, count=1, **kw)


def queue(*bodies: dict[str, Any], position: kueue.Position | None = None) -> ServiceQueue:
    base, count, steps = observe("team-a", list(bodies), BASE)
    return ServiceQueue("team-a", base, count, steps, {"gpu-a100": GPU}, position)


# ---- the Workloads -----------------------------------------------------------------------------------------


def test_the_minimum_is_one_pod_set_of_min_replicas_with_their_gpus() -> None:
    the_spec = autoscaled(low=2)
    [base] = workloads(OWNER, the_spec, pod(the_spec), "team-a", (0,), [])
    assert base["metadata"]["name"] == BASE and base["spec"]["queueName"] == "team-a"
    assert base["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    assert base["metadata"]["labels"][kueue.JOB_UID_LABEL] == "uid-1"
    assert STEP_LABEL not in base["metadata"]["labels"]
    [pod_set] = base["spec"]["podSets"]
    assert pod_set["name"] == "replicas" and pod_set["count"] == 2 and "minCount" not in pod_set
    requests = [c["resources"]["requests"] for c in pod_set["template"]["spec"]["containers"] if "resources" in c]
    assert any(r.get("nvidia.com/gpu") == "1" for r in requests)


def test_minimum_is_min_replicas_or_fixed_replicas_and_at_least_one() -> None:
    assert minimum(autoscaled(low=3)) == 3
    assert minimum(autoscaled(low=0)) == 1  # a scale-to-zero service keeps quota for one replica
    assert minimum(spec(replicas=4)) == 4
    assert minimum(spec()) == 1


def test_a_scale_step_is_one_replica_pinned_to_the_minimums_flavor() -> None:
    the_spec = autoscaled()
    [s1, s2] = workloads(OWNER, the_spec, pod(the_spec), "team-a", (1, 2), [GPU])
    assert s1["metadata"]["name"].endswith("-s1") and s1["metadata"]["labels"][STEP_LABEL] == "1"
    assert s2["metadata"]["name"] != s1["metadata"]["name"] and len(s2["metadata"]["name"]) <= 63
    [pod_set] = s1["spec"]["podSets"]
    assert pod_set["count"] == 1
    # Kueue admits only a flavor whose node labels agree with the template's selector: the step lands with the rest.
    assert pod_set["template"]["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod_set["template"]["spec"]["tolerations"]


# ---- admission ---------------------------------------------------------------------------------------------


def test_no_replica_before_the_minimum_is_created_and_admitted() -> None:
    adm = admit(queue(), autoscaled(), requested=2, running=0)
    assert (adm.state, adm.replicas, adm.create) == ("Queued", 0, (0,))
    waiting = admit(queue(wl(waiting="insufficient unused quota for nvidia.com/gpu")), autoscaled(), 2, 0)
    assert (waiting.state, waiting.replicas, waiting.create) == ("Queued", 0, ())
    assert "insufficient unused quota" in waiting.message


def test_admitted_minimum_runs_and_asks_a_step_per_replica_above_it() -> None:
    adm = admit(queue(wl(admitted=True)), autoscaled(low=2), requested=4, running=2)
    assert (adm.state, adm.replicas, adm.admitted) == ("Admitted", 2, 2)
    assert adm.create == (1, 2) and adm.queued_steps == 2 and adm.limited


def test_admitted_steps_add_replicas_and_waiting_ones_are_reported() -> None:
    q = queue(wl(admitted=True), step_wl(1, admitted=True), step_wl(2, waiting="insufficient quota"))
    adm = admit(q, autoscaled(low=2), requested=4, running=2)
    assert (adm.replicas, adm.admitted, adm.create, adm.queued_steps) == (3, 3, (), 1)
    assert adm.message == "1 scale step(s) of 2 waiting in LocalQueue team-a: insufficient quota"


def test_scaling_down_deletes_the_highest_steps_and_frees_their_quota() -> None:
    q = queue(wl(admitted=True), step_wl(1, admitted=True), step_wl(2, admitted=True), step_wl(3, admitted=True))
    adm = admit(q, autoscaled(low=2), requested=3, running=5)
    assert adm.replicas == 3 and not adm.limited
    assert [n[-2:] for n in adm.delete] == ["s3", "s2"]


def test_an_evicted_step_is_scaled_away_before_its_quota_is_released() -> None:
    q = queue(wl(admitted=True), step_wl(1, admitted=True), step_wl(2, evicted="Preempted"))
    still = admit(q, autoscaled(low=2), requested=4, running=4)
    assert still.replicas == 3 and still.release == () and still.evicted_steps[0].endswith("-s2")
    gone = admit(q, autoscaled(low=2), requested=4, running=3)
    assert [v.name[-2:] for v in gone.release] == ["s2"]
    assert gone.queued_steps == 1 and gone.create == ()  # s2 requeued: it waits for quota again


def test_an_evicted_minimum_stops_the_service_then_releases_and_drops_its_steps() -> None:
    q = queue(wl(evicted="Preempted"), step_wl(1, admitted=True))
    stopping = admit(q, autoscaled(low=2), requested=3, running=3)
    assert (stopping.state, stopping.replicas, stopping.release) == ("Evicting", 0, ())
    assert [n[-2:] for n in stopping.delete] == ["s1"]
    stopped = admit(q, autoscaled(low=2), requested=3, running=0)
    assert stopped.state == "Queued" and [v.name for v in stopped.release] == [BASE]
    # Released (no reservation any more) it waits like any queued Workload.
    again = admit(queue(wl(evicted="Preempted", reserved=False)), autoscaled(low=2), requested=3, running=0)
    assert (again.state, again.replicas, again.release) == ("Queued", 0, ())


def test_a_changed_minimum_replaces_its_workload_once_no_replica_runs() -> None:
    q = queue(wl(admitted=True, count=2))
    running = admit(q, autoscaled(low=3), requested=3, running=2)
    assert running.replicas == 0 and BASE not in running.delete
    stopped = admit(q, autoscaled(low=3), requested=3, running=0)
    assert BASE in stopped.delete


def test_status_reports_admission_flavor_position_and_what_waits() -> None:
    q = queue(wl(admitted=True), step_wl(1, waiting="insufficient quota"))
    adm = admit(q, autoscaled(low=2), requested=3, running=2)
    status = InferenceServiceStatus()
    events = report_status(status, adm, q, None, 1)
    assert status.queue is not None
    assert (status.queue.state, status.queue.flavor, status.queue.cluster_queue) == ("Admitted", "gpu-a100", "cq")
    assert (status.queue.requested_replicas, status.queue.admitted_replicas, status.queue.queued_steps) == (3, 2, 1)
    conds = {c.type: c for c in status.conditions}
    assert conds["Admitted"].status == "True"
    assert (conds["ScaleAdmitted"].status, conds["ScaleAdmitted"].reason) == ("False", "WaitingForQuota")
    assert "asks for 3 replica(s), Kueue admitted 2" in conds["ScaleAdmitted"].message
    assert any(e.reason == "WaitingForQuota" and e.type == "Warning" for e in events)

    pending = queue(wl(waiting="no quota"), position=kueue.Position(cluster_queue=2, local_queue=1))
    queued = InferenceServiceStatus()
    report_status(queued, admit(pending, autoscaled(), 2, 0), pending, None, 1)
    assert queued.queue is not None and (queued.queue.state, queued.queue.position) == ("Queued", 2)
    assert {c.type: c.status for c in queued.conditions}["Admitted"] == "False"


def test_pending_positions_count_from_one() -> None:
    summary = {
        "items": [
            {"metadata": {"name": "a"}, "positionInClusterQueue": 0, "positionInLocalQueue": 0},
            {"metadata": {"name": "b"}, "positionInClusterQueue": 3, "positionInLocalQueue": 1},
            {"metadata": {"name": "broken"}},
        ]
    }
    assert kueue.pending_positions(summary) == {
        "a": kueue.Position(cluster_queue=1, local_queue=1),
        "b": kueue.Position(cluster_queue=4, local_queue=2),
    }
    assert kueue.pending_positions(None) == {}
