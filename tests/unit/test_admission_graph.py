"""InferenceGraph admission checks: what the controller would report as GraphValid=False, refused with field paths.

The checks are the controller's own (`render.inferencegraph.graph_issues_of`); these tests pin the field paths and
messages admission gives them, and that admission and the controller's status never disagree.
"""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.admission import Violation
from loom.operator.admission.graph import graph_violations, spec_path
from loom.operator.kinds.inferencegraph.api import InferenceGraphSpec
from loom.operator.kinds.inferencegraph.render import router_config

HINT = "a step may not call a node that leads back to it"
OWNER = {"metadata": {"name": "g", "namespace": "ns", "uid": "u"}}


def step(**fields: Any) -> dict[str, Any]:
    return dict(fields)


def graph(router: str = "Sequence", **nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"nodes": {name: {"routerType": router, "steps": steps} for name, steps in nodes.items()}}


def test_an_acyclic_graph_with_shared_nodes_passes() -> None:
    spec = graph(
        root=[step(nodeName="a"), step(nodeName="b")],
        a=[step(nodeName="c")],
        b=[step(nodeName="c")],
        c=[step(serviceName="model")],
    )
    assert graph_violations(spec) == []


def test_a_cycle_is_reported_at_the_step_that_closes_it_in_call_order() -> None:
    spec = graph(b=[step(nodeName="root")], a=[step(nodeName="b")], root=[step(serviceName="m"), step(nodeName="a")])
    assert graph_violations(spec) == [
        Violation("spec.nodes[b].steps[0].nodeName", f"nodes form a cycle: root -> a -> b -> root; {HINT}")
    ]


def test_a_node_calling_itself_is_a_cycle() -> None:
    [violation] = graph_violations(graph(root=[step(serviceName="m"), step(nodeName="root")]))
    assert violation == Violation("spec.nodes[root].steps[1].nodeName", f"nodes form a cycle: root -> root; {HINT}")


def test_a_cycle_away_from_root_starts_at_the_smallest_name() -> None:
    spec = graph(root=[step(nodeName="x")], x=[step(serviceName="m")], z=[step(nodeName="y")], y=[step(nodeName="z")])
    assert graph_violations(spec) == [
        Violation("spec.nodes[z].steps[0].nodeName", f"nodes form a cycle: y -> z -> y; {HINT}")
    ]


def test_conditions_that_do_not_compile_are_named_with_the_librarys_message() -> None:
    spec = graph(
        "Switch",
        root=[
            step(serviceName="a", condition="request.inputs[0].data[0] > 0.5"),
            step(serviceName="b", condition="request.inputs[0] >"),
            step(serviceName="c", condition="reqest.x == 1"),
            step(serviceName="d", condition="request.inputs.all(i, i.name != '')"),
        ],
    )
    violations = graph_violations(spec)
    assert [v.field for v in violations] == [
        "spec.nodes[root].steps[1].condition",
        "spec.nodes[root].steps[2].condition",
    ]
    assert violations[0].message.startswith("does not compile: ")
    assert violations[1].message == (
        "does not compile: unknown variable(s) reqest: an expression can use only `request` and `response`"
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            graph("Splitter", root=[step(serviceName="a", weight=70), step(serviceName="b", weight=20)]),
            [Violation("spec.nodes[root].steps", "Splitter weights must sum to 100, they sum to 90")],
        ),
        (
            graph("Splitter", root=[step(serviceName="a", weight=100), step(serviceName="b")]),
            [Violation("spec.nodes[root].steps[1].weight", "every Splitter step needs a weight")],
        ),
        (
            graph("Splitter", root=[step(serviceName="a", weight=100, condition="true")]),
            [
                Violation(
                    "spec.nodes[root].steps[0].condition", "a Splitter step takes no condition (the weights choose)"
                )
            ],
        ),
        (
            graph("Switch", root=[step(serviceName="a", weight=100)]),
            [Violation("spec.nodes[root].steps[0].weight", "weight only applies to Splitter steps")],
        ),
        (
            graph("Ensemble", root=[step(serviceName="a"), step(serviceName="b", name="a")]),
            [
                Violation(
                    "spec.nodes[root].steps",
                    "Ensemble step names must be unique (they name the outputs), repeated: a; set `name` on the steps",
                )
            ],
        ),
        (
            graph(root=[step(serviceName="a", name="has space")]),
            [
                Violation(
                    "spec.nodes[root].steps[0].name",
                    "Value error, step name must be 1-63 characters of letters, digits, '_', '.', '-'",
                )
            ],
        ),
    ],
)
def test_the_routers_structural_rules_are_refused_at_their_field(
    spec: dict[str, Any], expected: list[Violation]
) -> None:
    assert graph_violations(spec) == expected


def test_every_problem_is_reported_at_once_as_the_controller_does() -> None:
    spec = graph(
        "Ensemble",
        root=[step(serviceName="a", weight=10), step(serviceName="a"), step(nodeName="x", condition="request >")],
        x=[step(nodeName="root")],
    )
    violations = graph_violations(spec)
    assert {v.field for v in violations} == {
        "spec.nodes[root].steps[0].weight",
        "spec.nodes[root].steps",
        "spec.nodes[x].steps[0].nodeName",
        "spec.nodes[root].steps[2].condition",
    }
    # One source: the controller's GraphValid message lists exactly these problems.
    _, problem = router_config(OWNER, InferenceGraphSpec.model_validate(spec), {})
    assert problem is not None and problem.reason == "InvalidGraph"
    for violation in violations:
        assert violation.message in problem.message


def test_a_spec_the_api_model_refuses_is_reported_at_its_path() -> None:
    [violation] = graph_violations(graph(root=[step(serviceName="a", weight=101)]))
    assert violation.field == "spec.nodes[root].steps[0].weight"
    assert "less than or equal to 100" in violation.message


def test_field_paths_put_map_keys_and_indexes_in_brackets() -> None:
    assert spec_path(("nodes", "root", "steps", 2, "weight")) == "spec.nodes[root].steps[2].weight"
    assert spec_path(("router", "timeoutMs")) == "spec.router.timeoutMs"


def test_a_misused_openai_chat_protocol_is_refused_at_its_step() -> None:
    chat = {"serviceName": "a", "protocol": "openai-chat"}
    mixed = graph(root=[chat, step(serviceName="b", data="$response")])
    assert [v.field for v in graph_violations(mixed)] == ["spec.nodes[root].steps[1].protocol"]
    oip_condition = graph("Switch", root=[{**chat, "condition": "request.inputs[0].data[0] > 0.5"}, chat])
    (violation,) = graph_violations(oip_condition)
    assert violation.field == "spec.nodes[root].steps[0].condition"
    assert violation.message.startswith("condition reads 'inputs', an OIP v2 field that an OpenAI chat body lacks")
    (violation,) = graph_violations(graph("Ensemble", root=[chat, {**chat, "serviceName": "b"}]))
    assert violation.field == "spec.nodes[root].steps" and "Ensemble" in violation.message
