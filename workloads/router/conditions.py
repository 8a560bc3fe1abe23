"""Step conditions in CEL (the expression language of Kubernetes validation rules).

Every condition is compiled once, when the router starts (or when the controller validates a
graph); a request only evaluates compiled programs. An expression sees two variables, both the JSON
documents as parsed (for the binary tensor extension: the JSON header):

- ``request``: the request the graph received;
- ``response``: the input of the node the step belongs to (the previous step's response when the
  node runs inside a Sequence after another step, else the graph's request).

An expression must evaluate to a bool. One that fails on a request (a missing field, an index out
of range, a non-bool result) is a ``condition_error`` (HTTP 400) naming the node, the step and the
expression, never silently false: guard optional fields with ``has(request.parameters.route)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import cel

from .config import RouterConfig

VARIABLES = frozenset({"request", "response"})
# Names bound by a comprehension macro (`list.all(x, ...)`): the CEL library lists them among the
# expression's variables, so they are not typos of `request` / `response`.
_MACRO_BINDING = re.compile(r"\.\s*(?:all|exists|exists_one|map|filter)\s*\(\s*([A-Za-z_]\w*)\s*,")


@dataclass(frozen=True)
class ConditionProblem:
    """A condition that does not compile, with where it is in the graph."""

    node: str
    step: int
    step_name: str
    expression: str
    message: str

    def __str__(self) -> str:
        return f"node {self.node!r} step {self.step} ({self.step_name}): condition {self.expression!r}: {self.message}"


class ConditionsError(ValueError):
    """One or more conditions do not compile; ``problems`` lists every one."""

    def __init__(self, problems: list[ConditionProblem]):
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


class ConditionEvalError(Exception):
    """A compiled condition failed on one request."""


@dataclass(frozen=True)
class Condition:
    expression: str
    program: cel.Program

    def holds(self, request: Any, response: Any) -> bool:
        try:
            value = self.program.execute({"request": request, "response": response})
        except Exception as exc:  # the library raises KeyError, IndexError, ValueError, RuntimeError ...
            raise ConditionEvalError(f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(value, bool):
            raise ConditionEvalError(f"must evaluate to a bool, got {type(value).__name__} {value!r}")
        return value


def compile_condition(expression: str) -> Condition:
    """Compile one expression; ValueError with the library's message (position and caret) on failure."""
    if not expression.strip():
        raise ValueError("the expression is empty")
    try:
        program = cel.compile(expression)
    except Exception as exc:
        raise ValueError(str(exc)) from exc
    bound = set(_MACRO_BINDING.findall(expression))
    unknown = sorted(set(program.variables()) - VARIABLES - bound)
    if unknown:
        raise ValueError(
            f"unknown variable(s) {', '.join(unknown)}: an expression can use only `request` and `response`"
        )
    return Condition(expression, program)


def condition_problems(config: RouterConfig) -> list[ConditionProblem]:
    """Every condition of the graph that does not compile (empty when all do)."""
    problems: list[ConditionProblem] = []
    for node_name, node in config.nodes.items():
        for index, step in enumerate(node.steps):
            if step.condition is None:
                continue
            try:
                compile_condition(step.condition)
            except ValueError as exc:
                problems.append(ConditionProblem(node_name, index, step.label, step.condition, str(exc)))
    return problems


def compile_conditions(config: RouterConfig) -> dict[tuple[str, int], Condition]:
    """All conditions by (node, step index); raises ConditionsError listing every bad one."""
    problems = condition_problems(config)
    if problems:
        raise ConditionsError(problems)
    return {
        (node_name, index): compile_condition(step.condition)
        for node_name, node in config.nodes.items()
        for index, step in enumerate(node.steps)
        if step.condition is not None
    }
