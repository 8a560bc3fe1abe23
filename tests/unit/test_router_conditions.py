"""CEL conditions: compiled once, evaluated over the JSON request and response, errors that say where."""

from __future__ import annotations

from typing import Any

import pytest

from loom.workloads.router.conditions import (
    ConditionEvalError,
    ConditionsError,
    compile_condition,
    compile_conditions,
    condition_problems,
)
from loom.workloads.router.config import RouterConfig

REQUEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [0.7, 3]}],
    "parameters": {"route": "fast", "tenant": "a"},
}
RESPONSE = {"model_name": "clf", "outputs": [{"name": "label", "datatype": "BYTES", "shape": [1], "data": ["cat"]}]}


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("request.inputs[0].data[0] > 0.5", True),
        ("request.inputs[0].data[1] > 2", True),  # ints and doubles compare
        ("request.inputs[0].data[0] > 0.9", False),
        ("request.parameters.route == 'fast'", True),
        ("has(request.parameters.missing) && request.parameters.missing == 'x'", False),
        ("request.parameters.tenant in ['a', 'b']", True),
        ("response.outputs[0].data[0] == 'cat'", True),
        ("request.inputs.exists(i, i.name == 'x')", True),
        ("request.inputs.all(i, i.shape[0] == 2) && size(request.inputs) == 1", True),
        ("response.model_name.startsWith('cl')", True),
    ],
)
def test_expressions_evaluate_over_request_and_response(expression: str, expected: bool) -> None:
    assert compile_condition(expression).holds(REQUEST, RESPONSE) is expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("request.inputs[0].data[0] >", "Syntax error"),
        ("request.inputs[0].data[0] >", "^"),  # the position is pointed at
        ("reqest.parameters.route == 'a'", "unknown variable(s) reqest"),
        ("   ", "empty"),
    ],
)
def test_compile_errors_are_clear(expression: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        compile_condition(expression)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("request.parameters.nope == 'a'", "KeyError"),
        ("request.inputs[3].data[0] > 1", "index"),
        ("request.inputs[0].data[0]", "must evaluate to a bool, got float"),
    ],
)
def test_evaluation_errors_are_errors_not_false(expression: str, message: str) -> None:
    condition = compile_condition(expression)
    with pytest.raises(ConditionEvalError) as caught:
        condition.holds(REQUEST, RESPONSE)
    assert message in str(caught.value)


def graph(conditions: list[str | None]) -> RouterConfig:
    steps: list[dict[str, Any]] = [{"serviceName": "a", "name": f"s{i}", **({"condition": c} if c else {})}
                                   for i, c in enumerate(conditions)]
    return RouterConfig.model_validate({
        "graphName": "g",
        "nodes": {"root": {"routerType": "Switch", "steps": steps}},
        "services": {"a": {"url": "http://a", "modelName": "a"}},
    })


def test_every_bad_condition_of_a_graph_is_listed_with_its_place() -> None:
    config = graph(["request.x ==", None, "true", "nope > 1"])
    found = condition_problems(config)
    assert [(p.node, p.step, p.step_name) for p in found] == [("root", 0, "s0"), ("root", 3, "s3")]
    assert str(found[1]).startswith("node 'root' step 3 (s3): condition 'nope > 1': unknown variable(s) nope")
    with pytest.raises(ConditionsError) as caught:
        compile_conditions(config)
    assert caught.value.problems == found
    assert "s0" in str(caught.value) and "s3" in str(caught.value)


def test_a_sound_graph_compiles_once_into_programs_by_place() -> None:
    compiled = compile_conditions(graph(["request.parameters.route == 'fast'", None, "true"]))
    assert sorted(compiled) == [("root", 0), ("root", 2)]
    assert compiled[("root", 0)].holds(REQUEST, REQUEST) is True
