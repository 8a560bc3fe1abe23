"""The pod list -> the cause a person must act on (loom.operator.core.pod_problems), from pod statuses shaped as
the kubelet (and the local stack's node agent) and the scheduler write them."""

from __future__ import annotations

from typing import Any

from loom.operator.core.pod_problems import REASONS, PodProblem, find_problem, pod_problems, scrub


def pod(
    name: str,
    *,
    waiting: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
    terminated: dict[str, Any] | None = None,
    init: bool = False,
    scheduled: dict[str, Any] | None = None,
    limit: str | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": None, "running": None, "terminated": None}
    if waiting is not None:
        state["waiting"] = waiting
    elif terminated is not None:
        state["terminated"] = terminated
    else:
        state["running"] = {"startedAt": "2026-01-01T00:00:00Z"}
    container = {"name": "main", "state": state, "lastState": {"terminated": last} if last else {}}
    status: dict[str, Any] = {"initContainerStatuses" if init else "containerStatuses": [container]}
    if scheduled is not None:
        status = {"conditions": [{"type": "PodScheduled", "status": "False", **scheduled}]}
    resources = {"limits": {"memory": limit}} if limit else {}
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "resources": resources}]},
        "status": status,
    }


def test_a_missing_secret_is_named_with_the_kubelets_message() -> None:
    stuck = pod(
        "fv-apply-1-x",
        waiting={"reason": "CreateContainerConfigError", "message": 'secret "redis-connection" not found'},
    )
    problem = find_problem([stuck])
    assert problem == PodProblem(
        "CreateContainerConfigError", "fv-apply-1-x", "main", 'secret "redis-connection" not found'
    )
    assert problem.message == (
        'pod fv-apply-1-x container main: CreateContainerConfigError: secret "redis-connection" not found'
    )


def test_an_init_container_and_a_missing_key_count_too() -> None:
    message = "couldn't find key AWS_SECRET_ACCESS_KEY in Secret ns/s3-credentials"
    problem = find_problem([pod("p", init=True, waiting={"reason": "CreateContainerConfigError", "message": message})])
    assert problem is not None and problem.detail == message  # a key's name is not its value


def test_pods_on_their_way_have_no_problem() -> None:
    starting = [
        pod("a", waiting={"reason": "ContainerCreating"}),
        pod("b", waiting={"reason": "PodInitializing"}),
        pod("c"),
        pod("d", terminated={"reason": "Completed", "exitCode": 0}),
        pod("e", scheduled={"reason": "SchedulingGated", "message": "gated"}),
        {"metadata": {"name": "f"}},
    ]
    assert find_problem(starting) is None
    assert find_problem([]) is None


def test_image_pull_and_crash_loop_with_the_last_termination() -> None:
    pull = pod("a", waiting={"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope:1"'})
    assert find_problem([pull]) == PodProblem("ImagePullBackOff", "a", "main", 'Back-off pulling image "nope:1"')
    crash = pod(
        "b",
        waiting={"reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container=main"},
        last={"reason": "Error", "exitCode": 3, "message": "ModuleNotFoundError: No module named 'handlers'"},
    )
    problem = find_problem([crash])
    assert problem is not None and problem.reason == "CrashLoopBackOff"
    assert problem.detail == "last terminated Error with exit code 3: ModuleNotFoundError: No module named 'handlers'"
    bare = pod("c", waiting={"reason": "CrashLoopBackOff", "message": "back-off 10s"})
    assert find_problem([bare]) == PodProblem("CrashLoopBackOff", "c", "main", "back-off 10s")


def test_oom_killed_names_the_memory_limit() -> None:
    looping = pod(
        "a", waiting={"reason": "CrashLoopBackOff"}, last={"reason": "OOMKilled", "exitCode": 137}, limit="2Gi"
    )
    problem = find_problem([looping])
    assert problem is not None and problem.reason == "OOMKilled" and "memory limit 2Gi" in problem.detail
    once = pod("b", terminated={"reason": "OOMKilled", "exitCode": 137})
    assert find_problem([once]) == PodProblem("OOMKilled", "b", "main", "killed for using more memory than it may")
    # OOMKilled once, running again: nothing to act on now.
    assert find_problem([pod("c", last={"reason": "OOMKilled", "exitCode": 137})]) is None


def test_unschedulable_carries_the_schedulers_message_and_can_be_left_to_the_caller() -> None:
    message = "0/5 nodes are available: 4 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint."
    stuck = pod("w-0", scheduled={"reason": "Unschedulable", "message": message})
    assert find_problem([stuck]) == PodProblem("Unschedulable", "w-0", None, message)
    assert find_problem([stuck], ignore={"Unschedulable"}) is None


def test_the_most_actionable_cause_wins_and_the_choice_is_stable() -> None:
    crash = pod("a", waiting={"reason": "CrashLoopBackOff"}, last={"reason": "Error", "exitCode": 1})
    secret = pod("z", waiting={"reason": "CreateContainerConfigError", "message": 'secret "s" not found'})
    other = pod("y", waiting={"reason": "CreateContainerConfigError", "message": 'secret "t" not found'})
    assert find_problem([crash, secret]) == find_problem([secret, crash])
    assert find_problem([crash, secret, other]) == find_problem([secret, other, crash])
    chosen = find_problem([crash, secret, other])
    assert chosen is not None and chosen.pod == "y"  # equal causes: the first pod by name
    gone = pod("b", waiting={"reason": "CreateContainerConfigError", "message": "x"}, deleting=True)
    assert pod_problems(gone) == []


def test_messages_never_carry_credentials() -> None:
    text = (
        "redis.exceptions.ConnectionError: redis://admin:hunter2@redis:6379 refused; "
        "connectionString=redis:6379,password=s3cr3t AWS_SECRET_ACCESS_KEY=abcd/efgh token: 'tok123'"
    )
    cleaned = scrub(text)
    for value in ("hunter2", "s3cr3t", "abcd/efgh", "tok123", "admin:"):
        assert value not in cleaned
    assert "redis://***@redis:6379" in cleaned and "password=***" in cleaned
    crash = pod("a", waiting={"reason": "CrashLoopBackOff"}, last={"reason": "Error", "exitCode": 1, "message": text})
    problem = find_problem([crash])
    assert problem is not None and "s3cr3t" not in problem.message and "hunter2" not in problem.message
    long = scrub("x" * 1000)
    assert len(long) == 300 and long.endswith("...")
    assert scrub("line one\n  line two") == "line one line two"


def test_every_reason_is_ranked() -> None:
    for reason in REASONS:
        assert find_problem([pod("a", waiting={"reason": reason, "message": "m"})]) is not None or reason in (
            "OOMKilled",
            "Unschedulable",
        )
