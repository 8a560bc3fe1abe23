"""Each kind's own name is bounded by what Loom names after it (`operator/api/kinds.py`, NameRule): the CRD refuses
a longer or differently shaped name with a root CEL rule, the controllers report it in status for an object the
rule did not see, and both say the same. Kubernetes alone would accept 253 characters with dots, and every child
apply would then fail in the operator's log only."""

from __future__ import annotations

import re
from typing import Any

import cel
import pytest

from loom.operator.admission.graph import graph_violations
from loom.operator.admission.handlers import CHECKS
from loom.operator.api.crd import crd_for
from loom.operator.api.kinds import FEATURE_VIEW, INFERENCE_GRAPH, INFERENCE_SERVICE, KINDS, TRAINING_JOB, Kind
from loom.operator.core.kit import labels
from loom.operator.kinds.inferencegraph import render as graph_render
from loom.operator.kinds.inferencegraph.api import InferenceGraphSpec
from loom.operator.kinds.inferenceservice import render as service_render
from loom.operator.kinds.inferenceservice.traffic.activator import activator_name
from loom.operator.kinds.trainingjob import render as job_render
from loom.operator.kinds.trainingjob.config import rendezvous_service_name

# Written out here rather than imported (kinds.DNS_LABEL_PATTERN): the oracle the children's names are held to
# must not change with the rule it checks.
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAMES = [
    "a", "model", "gpt-2", "a1", "x" * 53, "x" * 54, "x" * 55, "x" * 56, "x" * 63, "x" * 64, "x" * 129,
    "9lives", "-a", "a-", "a.b", "a_b", "Model",
]  # fmt: skip


def cel_rule(kind: Kind) -> Any:
    [entry] = crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert entry["message"] == kind.name_rule.message
    return cel.compile(entry["rule"])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_the_crds_rule_and_the_controllers_check_agree_on_every_name(kind: Kind) -> None:
    program = cel_rule(kind)
    for name in NAMES:
        assert program.execute({"self": {"metadata": {"name": name}}}) is (kind.name_rule.problem(name) is None), name


def service_names(kind: Kind, name: str) -> list[str]:
    """Everything Loom names after an object of `kind` that must be a DNS-1035 label."""
    if kind is INFERENCE_SERVICE:
        return [service_render.service_name(name), activator_name(name)]
    if kind is INFERENCE_GRAPH:
        return [graph_render.service_name(name)]
    if kind is TRAINING_JOB:
        return [rendezvous_service_name(name), job_render.worker_name(name, 0)]
    return []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_the_longest_name_allowed_names_valid_children_and_one_more_character_would_not(kind: Kind) -> None:
    longest = "x" * kind.name_rule.max_length
    owner = {"kind": kind.kind, "metadata": {"name": longest}}
    assert all(len(v) <= 63 for v in labels(owner, "c").values())
    assert all(DNS_LABEL.match(n) and len(n) <= 63 for n in service_names(kind, longest))
    one_more = longest + "x"
    too_long = [n for n in service_names(kind, one_more) if len(n) > 63]
    assert too_long or len(labels({**owner, "metadata": {"name": one_more}}, "c")[f"loom.dev/{kind.kind.lower()}"]) > 63
    assert kind.name_rule.problem(longest) is None and kind.name_rule.problem(one_more) is not None


def test_only_a_feature_views_name_may_have_dots() -> None:
    # A FeatureView's name is only a label value (its Services are named after its project).
    assert FEATURE_VIEW.name_rule.problem("drivers.v2") is None
    for kind in (TRAINING_JOB, INFERENCE_SERVICE, INFERENCE_GRAPH):
        assert kind.name_rule.problem("drivers.v2") == f"metadata.name must be {kind.name_rule.requirement}"


def test_the_message_says_why_and_what_fits() -> None:
    message = INFERENCE_SERVICE.name_rule.message
    assert message.startswith("metadata.name must be a DNS-1035 label")
    assert "at most 53 characters" in message and "<name>-activator" in message


def test_a_training_jobs_worker_hostnames_are_still_judged_by_its_worker_count() -> None:
    assert job_render.name_problem("a" * 54, 10) is None  # aaa...-worker-9: 63 characters
    assert job_render.name_problem("a" * 54, 11) is not None  # aaa...-worker-10: 64
    assert job_render.name_problem("a" * 53, 11) is None
    assert job_render.name_problem("9lives", 2) == TRAINING_JOB.name_rule.message


# ---- InferenceGraph: the webhook and the controller say it through the graph's issues, at metadata.name

SPEC: dict[str, Any] = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "model"}]}}}


def body(name: str, spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": spec}


def test_the_webhook_refuses_a_graph_name_its_router_service_cannot_have_at_metadata_name() -> None:
    _, errors, _ = CHECKS["inferencegraphs"]
    [violation] = errors(None, body("g" * 64))
    assert (violation.field, violation.message) == ("metadata.name", f"must be {INFERENCE_GRAPH.name_rule.requirement}")
    assert errors(None, body("g" * 63)) == []


def test_the_graph_name_is_listed_with_the_specs_own_problems() -> None:
    spec = {"nodes": {"root": {"routerType": "Switch", "steps": [{"serviceName": "a", "weight": 100}]}}}
    assert [v.field for v in graph_violations(spec, name="a.b")] == [
        "metadata.name",
        "spec.nodes[root].steps[0].weight",
    ]


def test_the_graph_controller_reports_the_same_problem_before_missing_services() -> None:
    [violation] = graph_violations(SPEC, name="g" * 64)
    _, problem = graph_render.router_config(body("g" * 64), InferenceGraphSpec.model_validate(SPEC), {})
    assert problem is not None and problem.reason == "InvalidGraph"
    assert violation.message in problem.message
    _, problem = graph_render.router_config(body("g" * 63), InferenceGraphSpec.model_validate(SPEC), {})
    assert problem is not None and problem.reason == "ServiceNotFound"
