"""An InferenceGraph's name is the model name its router serves (/v2/models/<name>/infer), which the router limits
to 128 characters while Kubernetes allows 253: admission refuses a longer name at `metadata.name`, and the
controller reports it as InvalidGraph, through the one list of graph issues (`render.inferencegraph.graph_issues_of`).
"""

from __future__ import annotations

from typing import Any

from loom.operator.admission.graph import graph_violations
from loom.operator.admission.handlers import CHECKS
from loom.operator.api.inferencegraph import InferenceGraphSpec
from loom.operator.render.inferencegraph import router_config

SPEC: dict[str, Any] = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "model"}]}}}
LONGEST = "g" * 128
TOO_LONG = "g" * 129
RULE = "1-128 characters of letters, digits, '_', '.', '-'"


def body(name: str, spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": spec}


def test_the_webhook_refuses_a_graph_name_over_128_characters_at_metadata_name() -> None:
    _, errors, _ = CHECKS["inferencegraphs"]
    [violation] = errors(None, body(TOO_LONG))
    assert violation.field == "metadata.name"
    assert RULE in violation.message
    assert errors(None, body(LONGEST)) == []


def test_the_name_is_listed_with_the_specs_own_problems() -> None:
    spec = {"nodes": {"root": {"routerType": "Switch", "steps": [{"serviceName": "a", "weight": 100}]}}}
    assert [v.field for v in graph_violations(spec, name=TOO_LONG)] == [
        "metadata.name",
        "spec.nodes[root].steps[0].weight",
    ]


def test_the_controller_reports_the_same_problem_before_missing_services() -> None:
    [violation] = graph_violations(SPEC, name=TOO_LONG)
    _, problem = router_config(body(TOO_LONG), InferenceGraphSpec.model_validate(SPEC), {})
    assert problem is not None and problem.reason == "InvalidGraph"
    assert violation.message in problem.message
    _, problem = router_config(body(LONGEST), InferenceGraphSpec.model_validate(SPEC), {})
    assert problem is not None and problem.reason == "ServiceNotFound"
