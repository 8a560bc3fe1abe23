"""InferenceGraph admission checks: cycles between nodes and step conditions that do not compile."""

from __future__ import annotations

from typing import Any

from loom.operator.admission import Violation
from loom.operator.admission.graph import condition_violations, cycle_violations, graph_violations


def step(**fields: Any) -> dict[str, Any]:
    return dict(fields)


def graph(**nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"nodes": {name: {"routerType": "Sequence", "steps": steps} for name, steps in nodes.items()}}


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
    assert cycle_violations(spec) == [
        Violation(
            "spec.nodes[b].steps[0].nodeName",
            "nodes form a cycle: root -> a -> b -> root; a step may not call a node that leads back to it",
        )
    ]


def test_a_node_calling_itself_is_a_cycle() -> None:
    [violation] = cycle_violations(graph(root=[step(serviceName="m"), step(nodeName="root")]))
    assert violation.field == "spec.nodes[root].steps[1].nodeName"
    assert "root -> root" in violation.message


def test_a_cycle_away_from_root_starts_at_the_smallest_name() -> None:
    spec = graph(root=[step(nodeName="x")], x=[step(serviceName="m")], z=[step(nodeName="y")], y=[step(nodeName="z")])
    [violation] = cycle_violations(spec)
    assert violation == Violation(
        "spec.nodes[z].steps[0].nodeName",
        "nodes form a cycle: y -> z -> y; a step may not call a node that leads back to it",
    )


def test_names_outside_the_graph_are_left_to_the_crds_cel_rule() -> None:
    assert cycle_violations(graph(root=[step(nodeName="ghost")])) == []


def test_conditions_that_do_not_compile_are_named_with_the_librarys_message() -> None:
    spec = {
        "nodes": {
            "root": {
                "routerType": "Switch",
                "steps": [
                    step(serviceName="a", condition="request.inputs[0].data[0] > 0.5"),
                    step(serviceName="b", condition="request.inputs[0] >"),
                    step(serviceName="c", condition="reqest.x == 1"),
                    step(serviceName="d", condition="request.inputs.all(i, i.name != '')"),
                ],
            }
        }
    }
    violations = condition_violations(spec)
    assert [v.field for v in violations] == [
        "spec.nodes[root].steps[1].condition",
        "spec.nodes[root].steps[2].condition",
    ]
    assert violations[0].message.startswith("does not compile: ")
    assert "unknown variable(s) reqest" in violations[1].message
