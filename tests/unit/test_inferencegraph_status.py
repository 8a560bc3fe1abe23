"""InferenceGraph status: Ready only when the router is available and every Hard dependency is Ready; per-node and
per-step readiness; phase; problems as conditions; events on transitions only."""

from __future__ import annotations

from typing import Any

from loom.operator.kinds.inferencegraph.api import InferenceGraphSpec, InferenceGraphStatus
from loom.operator.kinds.inferencegraph.render import GraphProblem, ServiceRef
from loom.operator.kinds.inferencegraph.status import Observed, compute_status

OWNER = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "InferenceGraph",
    "metadata": {"name": "bot", "namespace": "team", "uid": "u", "generation": 5},
}
SPEC = InferenceGraphSpec.model_validate(
    {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    {"name": "classify", "serviceName": "classifier", "dependency": "Hard"},
                    {"nodeName": "route", "data": "$response", "dependency": "Hard"},
                ],
            },
            "route": {
                "routerType": "Switch",
                "steps": [
                    {"serviceName": "billing", "condition": "true"},  # Soft
                    {"serviceName": "general", "dependency": "Hard"},
                ],
            },
        }
    }
)


def service(name: str, ready: bool = True, reason: str | None = None) -> ServiceRef:
    return ServiceRef(name, f"http://{name}.team.svc:80", name, ready, reason or ("Serving" if ready else "Loading"))


def all_services(**not_ready: str) -> dict[str, ServiceRef]:
    return {n: service(n, n not in not_ready, not_ready.get(n)) for n in ("classifier", "billing", "general")}


def router(ready: int = 1, available: bool = True, stuck: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Available", "status": "True" if available else "False"}]
    if stuck:
        conditions.append({"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                           "message": "ReplicaSet bot-router-x has timed out progressing."})  # fmt: skip
    return {"spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": ready, "conditions": conditions}}


def conditions(status: InferenceGraphStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def message(status: InferenceGraphStatus, ctype: str) -> str:
    return next(c.message for c in status.conditions if c.type == ctype)


def test_ready_when_router_available_and_every_service_ready() -> None:
    status, events = compute_status(OWNER, SPEC, Observed(router(), all_services()), None)
    assert conditions(status) == {
        "GraphValid": ("True", "Valid"),
        "DependenciesReady": ("True", "DependenciesReady"),
        "RouterAvailable": ("True", "Available"),
        "Ready": ("True", "Serving"),
    }
    assert status.phase == "Ready"
    assert status.url == "http://bot.team.svc"
    assert (status.ready_replicas, status.services, status.observed_generation) == (1, "3/3", 5)
    assert all(c.observed_generation == 5 for c in status.conditions)
    assert {(e.type, e.reason) for e in events} == {
        ("Normal", "Valid"), ("Normal", "DependenciesReady"), ("Normal", "Available"), ("Normal", "Serving"),
    }  # fmt: skip


def test_per_node_and_step_readiness() -> None:
    status, _ = compute_status(OWNER, SPEC, Observed(router(), all_services(general="LoadFailed")), None)
    nodes = {n.name: n for n in status.nodes}
    assert nodes["route"].router_type == "Switch" and nodes["route"].ready is False
    steps = {s.name: (s.ready, s.reason, s.dependency) for s in nodes["route"].steps}
    assert steps == {"billing": (True, None, "Soft"), "general": (False, "LoadFailed", "Hard")}
    root = {s.name: (s.ready, s.reason) for s in nodes["root"].steps}
    assert root == {"classify": (True, None), "route": (False, "NodeNotReady")}  # a node step follows its node
    assert status.services == "2/3"


def test_a_hard_dependency_not_ready_holds_ready_back() -> None:
    status, _ = compute_status(OWNER, SPEC, Observed(router(), all_services(general="Loading")), None)
    assert conditions(status)["DependenciesReady"] == ("False", "ServiceNotReady")
    assert conditions(status)["Ready"] == ("False", "ServiceNotReady")
    assert "general (Loading)" in message(status, "Ready")
    assert status.phase == "Pending"


def test_a_soft_dependency_not_ready_serves_degraded() -> None:
    status, _ = compute_status(OWNER, SPEC, Observed(router(), all_services(billing="Loading")), None)
    assert conditions(status)["Ready"] == ("True", "Serving")
    assert "billing" in message(status, "DependenciesReady")
    assert status.phase == "Degraded"


def test_router_not_available_holds_ready_back() -> None:
    status, _ = compute_status(OWNER, SPEC, Observed(router(ready=0, available=False), all_services()), None)
    assert conditions(status)["RouterAvailable"] == ("False", "Starting")
    assert conditions(status)["Ready"] == ("False", "Starting")
    assert status.phase == "Pending"
    stuck, _ = compute_status(OWNER, SPEC, Observed(router(0, False, stuck=True), all_services()), None)
    assert conditions(stuck)["Ready"] == ("False", "ProgressDeadlineExceeded")
    assert stuck.phase == "Failed"


def test_missing_service_waits() -> None:
    services = {k: v for k, v in all_services().items() if k != "general"}
    problem = GraphProblem("ServiceNotFound", "InferenceService(s) not found: general")
    status, events = compute_status(OWNER, SPEC, Observed(None, services, problem), None)
    assert conditions(status)["GraphValid"] == ("True", "Valid")
    assert conditions(status)["DependenciesReady"] == ("False", "ServiceNotFound")
    assert conditions(status)["RouterAvailable"] == ("False", "NotCreated")
    assert conditions(status)["Ready"] == ("False", "ServiceNotFound")
    assert status.phase == "Pending" and status.services == "2/3"
    assert ("Warning", "ServiceNotFound") in {(e.type, e.reason) for e in events}


def test_invalid_graph_fails_without_a_router_and_degrades_with_one() -> None:
    problem = GraphProblem("InvalidGraph", "nodes form a cycle: root -> a -> root")
    status, events = compute_status(OWNER, SPEC, Observed(None, all_services(), problem), None)
    assert conditions(status)["GraphValid"] == ("False", "InvalidGraph")
    assert conditions(status)["Ready"] == ("False", "InvalidGraph")
    assert message(status, "Ready") == "nodes form a cycle: root -> a -> root"
    assert status.phase == "Failed"
    assert ("Warning", "InvalidGraph") in {(e.type, e.reason) for e in events}
    # The router of the last good graph still serves: the graph is degraded, not down.
    serving, _ = compute_status(OWNER, SPEC, Observed(router(), all_services(), problem), None)
    assert serving.phase == "Degraded" and conditions(serving)["Ready"] == ("False", "InvalidGraph")


def test_a_spec_that_does_not_validate_still_gets_a_status() -> None:
    problem = GraphProblem("InvalidGraph", "spec.nodes: Field required")
    status, _ = compute_status(OWNER, None, Observed(None, {}, problem), None)
    assert status.phase == "Failed" and status.nodes == [] and status.services == "0/0"
    assert conditions(status)["Ready"] == ("False", "InvalidGraph")


def test_events_only_on_transitions() -> None:
    first, _ = compute_status(OWNER, SPEC, Observed(router(ready=0, available=False), all_services()), None)
    again, events = compute_status(OWNER, SPEC, Observed(router(ready=0, available=False), all_services()), first)
    assert events == []
    assert again.conditions == first.conditions
    ready, events = compute_status(OWNER, SPEC, Observed(router(), all_services()), again)
    assert {e.reason for e in events} == {"Available", "Serving"}
    became_ready = next(c for c in ready.conditions if c.type == "Ready")
    assert became_ready.last_transition_time is not None


def test_a_router_pod_that_cannot_start_is_named_in_router_available_and_ready() -> None:
    from loom.operator.core.pod_problems import PodProblem

    missing = PodProblem("CreateContainerConfigError", "g-router-abc", "router", 'secret "api-keys" not found')
    starting = {"status": {"replicas": 1, "readyReplicas": 0, "conditions": []}}
    status, events = compute_status(OWNER, SPEC, Observed(starting, all_services(), None, missing), None)
    router = next(c for c in status.conditions if c.type == "RouterAvailable")
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert (router.status, router.reason) == ("False", "CreateContainerConfigError")
    assert (ready.status, ready.reason) == ("False", "CreateContainerConfigError")
    assert 'secret "api-keys" not found' in ready.message and "g-router-abc" in ready.message
    warned = [e for e in events if e.reason == "CreateContainerConfigError"]
    assert warned and all(e.type == "Warning" for e in warned)
    _, again = compute_status(OWNER, SPEC, Observed(starting, all_services(), None, missing), status)
    assert again == []
    plain, _ = compute_status(OWNER, SPEC, Observed(starting, all_services()), None)
    assert next(c for c in plain.conditions if c.type == "RouterAvailable").reason == "Starting"
