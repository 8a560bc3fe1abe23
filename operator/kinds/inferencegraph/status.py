"""InferenceGraph status from what runs: the router Deployment and the InferenceServices the graph names (pure).

Conditions:
- GraphValid: False / InvalidGraph when what admission cannot check fails (a cycle, a CEL condition that does
  not compile, ...), with every problem in the message. Nothing new is rendered; a running router keeps serving.
- DependenciesReady: every InferenceService a Hard step names exists and is Ready (ServiceNotFound /
  ServiceNotReady otherwise). Soft steps' services are reported per step but do not hold the graph back: a
  failing Soft step is skipped by the router.
- RouterAvailable: the router Deployment has an available replica.
- Ready: the graph is valid, the router is available and every Hard dependency is Ready.

Phase: Ready (Ready, every referenced service Ready), Degraded (serving, but a Soft service is not Ready, or the
new spec is invalid while the router of an older one serves), Failed (invalid and nothing serving, or the router
rollout is stuck), Pending otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...core.kit import Condition, Event, Manifest, condition_events, set_condition
from ...core.pod_problems import REASONS as POD_REASONS
from ...core.pod_problems import PodProblem
from .api import GraphPhase, GraphStep, InferenceGraphSpec, InferenceGraphStatus, NodeStatus, StepStatus
from .render import GraphProblem, ServiceRef, graph_url, hard_services, referenced_services, selector_string


@dataclass(frozen=True)
class Observed:
    """What the controller read and applied in this pass."""

    deployment: Manifest | None  # the router Deployment as applied, or as live when nothing was applied
    services: Mapping[str, ServiceRef]  # the referenced InferenceServices that exist
    problem: GraphProblem | None = None
    pod_problem: PodProblem | None = None  # why a router pod cannot start (pod_problems)


def _int(deployment: Manifest | None, field: str) -> int:
    return int(((deployment or {}).get("status") or {}).get(field, 0))


def _deployment_condition(deployment: Manifest | None, ctype: str) -> Manifest:
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return {}


def router_available(deployment: Manifest | None) -> bool:
    """The Deployment says Available and a replica is ready to answer."""
    return _deployment_condition(deployment, "Available").get("status") == "True" and _int(
        deployment, "readyReplicas"
    ) > 0


def _stuck(deployment: Manifest | None) -> str | None:
    cond = _deployment_condition(deployment, "Progressing")
    if cond.get("reason") == "ProgressDeadlineExceeded":
        return str(cond.get("message") or "the router rollout made no progress")
    return None


def node_statuses(spec: InferenceGraphSpec, services: Mapping[str, ServiceRef]) -> list[NodeStatus]:
    """Per node and step: is its target ready (a nodeName step: every step of that node, recursively)."""
    memo: dict[str, bool] = {}

    def node_ready(name: str, visiting: frozenset[str]) -> bool:
        if name in memo:
            return memo[name]
        if name in visiting or name not in spec.nodes:
            return False  # a cycle or a dangling reference: reported by GraphValid
        ok = all(step_ready(s, visiting | {name})[0] for s in spec.nodes[name].steps)
        memo[name] = ok
        return ok

    def step_ready(step: GraphStep, visiting: frozenset[str]) -> tuple[bool, str | None]:
        service, node = step.service_name, step.node_name
        if service is not None:
            ref = services.get(service)
            if ref is None:
                return False, "NotFound"
            return ref.ready, None if ref.ready else (ref.reason or "NotReady")
        ok = node_ready(str(node), visiting)
        return ok, None if ok else "NodeNotReady"

    result = []
    for name, node in spec.nodes.items():
        steps = []
        for step in node.steps:
            ready, reason = step_ready(step, frozenset({name}))
            steps.append(
                StepStatus(
                    name=step.name or step.service_name or step.node_name or "?",
                    service_name=step.service_name,
                    node_name=step.node_name,
                    dependency=step.dependency,
                    ready=ready,
                    reason=reason,
                )
            )
        result.append(
            NodeStatus(name=name, router_type=node.router_type, ready=all(s.ready for s in steps), steps=steps)
        )
    return result


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int | None) -> Condition:
    return Condition(
        type=ctype, status="True" if ok else "False", reason=reason, message=message, observed_generation=generation
    )


def _dependencies(
    spec: InferenceGraphSpec | None, services: Mapping[str, ServiceRef], generation: int | None
) -> Condition:
    if spec is None:
        return _condition("DependenciesReady", False, "InvalidGraph", "the spec does not validate", generation)
    hard = hard_services(spec)
    missing = sorted(name for name in hard if name not in services)
    waiting = sorted(name for name in hard if name in services and not services[name].ready)
    soft = [name for name in referenced_services(spec) if name not in hard]
    soft_down = [name for name in soft if not (name in services and services[name].ready)]
    soft_note = f"; Soft steps' services not ready (skipped if they fail): {', '.join(soft_down)}" if soft_down else ""
    if missing:
        return _condition(
            "DependenciesReady", False, "ServiceNotFound",
            f"InferenceService(s) of Hard steps not found: {', '.join(missing)}{soft_note}", generation,
        )  # fmt: skip
    if waiting:
        detail = ", ".join(f"{n} ({services[n].reason or 'NotReady'})" for n in waiting)
        return _condition(
            "DependenciesReady", False, "ServiceNotReady", f"InferenceService(s) not Ready: {detail}{soft_note}",
            generation,
        )  # fmt: skip
    message = f"Hard dependencies Ready: {', '.join(sorted(hard))}" if hard else "no Hard dependency"
    return _condition("DependenciesReady", True, "DependenciesReady", message + soft_note, generation)


def compute_status(
    owner: Manifest,
    spec: InferenceGraphSpec | None,
    observed: Observed,
    previous: InferenceGraphStatus | None,
) -> tuple[InferenceGraphStatus, list[Event]]:
    """The new status and the events its condition transitions deserve."""
    generation = owner.get("metadata", {}).get("generation")
    deployment, services, problem = observed.deployment, observed.services, observed.problem
    invalid = problem is not None and problem.reason == "InvalidGraph"

    valid = (
        _condition("GraphValid", False, "InvalidGraph", problem.message, generation)
        if invalid and problem is not None
        else _condition("GraphValid", True, "Valid", "the graph is valid", generation)
    )
    dependencies = _dependencies(spec, services, generation)
    available = router_available(deployment)
    ready_replicas = _int(deployment, "readyReplicas")
    stuck = _stuck(deployment)
    if available:
        message = f"{ready_replicas} router replica(s) ready"
        router = _condition("RouterAvailable", True, "Available", message, generation)
    elif stuck is not None:
        router = _condition("RouterAvailable", False, "ProgressDeadlineExceeded", stuck, generation)
    elif deployment is None:
        why = problem.message if problem is not None else "the router is not created yet"
        router = _condition("RouterAvailable", False, "NotCreated", why, generation)
    elif (pod := observed.pod_problem) is not None:
        router = _condition("RouterAvailable", False, pod.reason, f"no router replica ready: {pod.message}", generation)
    else:
        router = _condition("RouterAvailable", False, "Starting", "no router replica ready yet", generation)

    if invalid:
        ready = _condition("Ready", False, "InvalidGraph", valid.message, generation)
    elif problem is not None:  # ServiceNotFound: nothing rendered for this generation yet
        ready = _condition("Ready", False, problem.reason, problem.message, generation)
    elif router.reason in POD_REASONS:  # the router cannot start: a person must act, whatever the services do
        ready = _condition("Ready", False, router.reason, router.message, generation)
    elif dependencies.status != "True":
        ready = _condition("Ready", False, dependencies.reason, dependencies.message, generation)
    elif router.status != "True":
        ready = _condition("Ready", False, router.reason, router.message, generation)
    else:
        ready = _condition("Ready", True, "Serving", f"serving at {graph_url(owner)}", generation)

    old = list(previous.conditions) if previous else []
    conditions = old
    for cond in (valid, dependencies, router, ready):
        conditions = set_condition(conditions, cond)

    nodes = node_statuses(spec, services) if spec is not None else []
    wanted = referenced_services(spec) if spec is not None else []
    ready_services = sum(1 for name in wanted if name in services and services[name].ready)
    status = InferenceGraphStatus(
        observed_generation=generation,
        conditions=conditions,
        phase=_phase(invalid, available, stuck, ready.status == "True", ready_services == len(wanted)),
        url=graph_url(owner),
        replicas=_int(deployment, "replicas"),
        ready_replicas=ready_replicas,
        selector=selector_string(owner),  # the scale subresource's labelSelectorPath
        services=f"{ready_services}/{len(wanted)}",
        nodes=nodes,
        # Written by the autoscaler (autoscale/loop.py); carried so this pass never clears it.
        autoscaling=previous.autoscaling if previous else None,
    )
    return status, condition_events(old, conditions, WARNING_REASONS)


def _phase(invalid: bool, available: bool, stuck: str | None, ready: bool, all_services_ready: bool) -> GraphPhase:
    if invalid:
        return "Degraded" if available else "Failed"
    if ready:
        return "Ready" if all_services_ready else "Degraded"
    if stuck is not None:
        return "Failed"
    return "Pending"


WARNING_REASONS = {
    "InvalidGraph", "ServiceNotFound", "ServiceNotReady", "ProgressDeadlineExceeded", "ServiceNameConflict",
    "FeatureViewNotFound", "FeatureViewNotReady", *POD_REASONS,
}  # fmt: skip
