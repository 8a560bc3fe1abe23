"""loom.operator.api.cel: the CRDs' CEL rules evaluated outside the API server (the SDK's validate, `admitted` in
the tests), the one place they are checked before admission. Its messages and field paths are the API server's
(kube-apiserver refuses the same objects with the same lines: e2e/tests/test_crds_admission.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import KUBERNETES_FUNCTIONS, admitted, cel_problems, program
from loom.operator.api.crd import crd_for
from loom.operator.api.kinds import INFERENCE_GRAPH, INFERENCE_SERVICE, KINDS, Kind
from loom.operator.core.model import ApiModel, cel, validations
from loom.operator.kinds.inferencegraph.api import GraphNode
from loom.operator.kinds.inferenceservice.api import InferenceService
from loom.operator.kinds.inferenceservice.canary.api import Analysis

# What the binding's Rust core evaluates itself (cel-rust: the macros, the conversions, size and the string
# predicates); any other function a rule calls must be one of KUBERNETES_FUNCTIONS, or the rule would err here.
CORE_FUNCTIONS = {
    "size", "matches", "startsWith", "endsWith", "contains", "has", "all", "exists", "exists_one", "map", "filter",
    "int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration", "dyn", "type",
}


def rules(node: Any) -> Iterator[dict[str, str]]:
    if isinstance(node, dict):
        yield from node.get("x-kubernetes-validations") or []
        for value in node.values():
            yield from rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from rules(value)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_every_function_a_crd_rule_calls_is_evaluated_here(kind: Kind) -> None:
    for rule in rules(crd_for(kind)):
        for expression in filter(None, (rule["rule"], rule.get("messageExpression"))):
            # Operators come as _+_, !_, @in: only named functions can be missing.
            called = {name for name in program(expression).functions() if name[0].isalpha()}
            assert called <= CORE_FUNCTIONS | set(KUBERNETES_FUNCTIONS), (expression, called)


def test_the_kubernetes_list_functions_mean_what_they_mean_in_the_api_server() -> None:
    # isSorted allows equal neighbours (a separate rule refuses them); sum adds the weights.
    with pytest.raises(ValidationError, match="step weights must increase \\["):
        admitted(Analysis, {"steps": [{"weight": 50}, {"weight": 10}]})
    with pytest.raises(ValidationError, match="step weights must increase: a weight appears twice"):
        admitted(Analysis, {"steps": [{"weight": 50}, {"weight": 50}]})
    assert admitted(Analysis, {"steps": [{"weight": 10}, {"weight": 50}]}).steps[1].weight == 50
    split = {"routerType": "Splitter", "steps": [{"serviceName": "a", "weight": 30}, {"serviceName": "b"}]}
    with pytest.raises(ValidationError, match="Splitter weights must sum to 100"):
        admitted(GraphNode, split)
    split["steps"][1]["weight"] = 70
    assert admitted(GraphNode, split).router_type == "Splitter"


def service(**spec: Any) -> dict[str, Any]:
    wire: dict[str, Any] = InferenceService.model_validate(
        {"metadata": {"name": "chat"}, "spec": {"model": {"uri": "s3://m/x", "name": "llama"}, **spec}}).to_wire()
    return wire


def test_problems_name_their_field_as_the_api_server_does() -> None:
    adapters = [{"name": "pirate", "uri": "s3://a/b"}, {"name": "poet", "uri": "s3://a/c", "mlflow": "models:/p/1"},
                {"name": "pirate", "uri": "s3://a/d"}]
    assert cel_problems(INFERENCE_SERVICE, service(runtime="vllm", adapters=adapters)) == [
        "spec.adapters: adapter names must be unique: pirate appears more than once",  # its messageExpression
        "spec.adapters[1]: set exactly one of uri, mlflow or fromTrainingJob",
    ]
    assert cel_problems(INFERENCE_SERVICE, service(rollout={"canaryPercent": 10, "analysis": {"steps": [
        {"weight": 10}]}})) == ["spec.rollout.analysis: set canaryPercent or analysis, not both"]
    # The name rule is the root's; the status is not validated; a manifest without a name leaves the name rule out.
    long = {**service(), "metadata": {"name": "x" * 60}, "status": {"phase": "nonsense"}}
    [problem] = cel_problems(INFERENCE_SERVICE, long)
    assert problem.startswith("metadata.name: metadata.name must be a DNS-1035 label")
    assert cel_problems(INFERENCE_SERVICE, {"spec": service()["spec"]}) == []


def test_graph_maps_are_written_with_their_keys() -> None:
    graph = {"metadata": {"name": "g"}, "spec": {"nodes": {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a", "nodeName": "root"}]}}}}
    assert cel_problems(INFERENCE_GRAPH, graph) == ["spec.nodes[root].steps[0]: set exactly one of serviceName or "
                                                    "nodeName"]


class Probe(ApiModel):
    model_config = validations(
        cel("self.n > 1", "n must be above 1", field_path=".n", message_expression="self.missing"),
        cel("!has(self.m) || self.m.nope > 1", "m must be above 1", field_path=".m"),
    )

    n: int = 0
    m: dict[str, int] | None = None


def test_admitted_refuses_as_pydantic_does_with_the_rules_message_at_its_field() -> None:
    with pytest.raises(ValidationError) as caught:
        admitted(Probe, {"n": 0})
    [error] = caught.value.errors()
    # A messageExpression that errs gives way to the message, as in the API server.
    assert (error["loc"], error["msg"]) == (("n",), "n must be above 1")
    with pytest.raises(ValidationError, match="Input should be a valid integer"):
        admitted(Probe, {"n": "two"})  # the model's own check comes first
    assert admitted(Probe, {"n": 2}).n == 2


def test_a_rule_that_errs_refuses_the_object_as_the_api_server_does() -> None:
    with pytest.raises(ValidationError, match="m must be above 1 \\(the rule could not be evaluated"):
        admitted(Probe, {"n": 2, "m": {"other": 1}})
