"""InferenceGraph checks CEL cannot do: cycles between nodes, and step conditions that do not compile.

The CRD's CEL rules already require a `root` node and that every `nodeName` names a node of the graph; they
cannot follow the calls transitively (a cycle would make the router recurse until the request's deadline) and
cannot compile the conditions the router evaluates (compiled here with the router's own `compile_condition`, the
same library and the same variable rules, so what admission accepts the router can run).
"""

from __future__ import annotations

import graphlib
from collections.abc import Mapping
from typing import Any

from loom.workloads.router.conditions import compile_condition

from . import Violation, step_path

ROOT = "root"


def _steps(spec: Mapping[str, Any]) -> list[tuple[str, int, Mapping[str, Any]]]:
    return [
        (name, index, step)
        for name, node in (spec.get("nodes") or {}).items()
        for index, step in enumerate((node or {}).get("steps") or [])
    ]


def cycle_violations(spec: Mapping[str, Any]) -> list[Violation]:
    """A cycle of `nodeName` calls (one, reported at the step that closes it), or nothing."""
    nodes = spec.get("nodes") or {}
    calls: dict[str, set[str]] = {name: set() for name in nodes}
    for name, _, step in _steps(spec):
        target = step.get("nodeName")
        if isinstance(target, str) and target in nodes:  # a name outside the graph is CEL's to refuse
            calls[name].add(target)
    try:
        # graphlib reads the mapping as node -> its predecessors: a callee comes "before" its caller.
        graphlib.TopologicalSorter(calls).prepare()
    except graphlib.CycleError as error:
        # args[1] lists nodes each of which the next one calls, ending where it started: reversed, the calls.
        cycle: list[str] = list(reversed(error.args[1]))
        # Told from `root` when it is on the cycle, else from the smallest name (map keys have no order).
        start = min(range(len(cycle) - 1), key=lambda i: (cycle[i] != ROOT, cycle[i]))
        path = [*cycle[start:-1], *cycle[:start], cycle[start]]
        caller, callee = path[-2], path[-1]
        index = next(i for n, i, step in _steps(spec) if n == caller and step.get("nodeName") == callee)
        return [
            Violation(
                step_path(caller, index, "nodeName"),
                f"nodes form a cycle: {' -> '.join(path)}; a step may not call a node that leads back to it",
            )
        ]
    return []


def condition_violations(spec: Mapping[str, Any]) -> list[Violation]:
    """Every step condition that does not compile, with the library's message."""
    problems = []
    for name, index, step in _steps(spec):
        expression = step.get("condition")
        if expression is None:
            continue
        try:
            compile_condition(expression)
        except ValueError as error:
            problems.append(Violation(step_path(name, index, "condition"), f"does not compile: {error}"))
    return problems


def graph_violations(spec: Mapping[str, Any]) -> list[Violation]:
    return cycle_violations(spec) + condition_violations(spec)
