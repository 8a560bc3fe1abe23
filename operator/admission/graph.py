"""InferenceGraph checks CEL cannot do: everything the controller would report as GraphValid=False.

The CRD's CEL rules already require a `root` node, that every `nodeName` names a node of the graph and that
Splitter weights are set and sum to 100; they cannot follow the calls transitively (a cycle would make the router
recurse until the request's deadline), compile the conditions the router evaluates, apply the router's own
step model (unique Ensemble step names, weights only on Splitter steps, no condition on a Splitter step, ...).
The graph's name is judged too (INFERENCE_GRAPH.name_rule, which the CRD's root rule also checks): the webhook may
be installed on a cluster whose CRDs predate that rule.
Nothing is checked here that is not checked there: the spec goes through the operator's API model and then
`render.inferencegraph.graph_issues_of`, the very function whose result the controller reports in status (the
router's `graph_issues` and its CEL compiler), so what admission accepts the controller renders and the router
runs. Each problem keeps its place as a field path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from loom.workloads.router.config import GraphIssue

from ..kinds.inferencegraph.api import InferenceGraphSpec
from ..kinds.inferencegraph.render import NAME_FIELD, graph_issues_of
from . import Violation, step_path

# Fields of the spec that are maps: the key that follows one is written in brackets, as the API server does.
_MAPS = frozenset({"nodes"})


def spec_path(loc: Sequence[int | str]) -> str:
    """A pydantic error location under `spec` (wire names) as a field path: `spec.nodes[root].steps[0].weight`."""
    path = "spec"
    for i, part in enumerate(loc):
        if isinstance(part, int) or (i > 0 and loc[i - 1] in _MAPS):
            path += f"[{part}]"
        else:
            path += f".{part}"
    return path


def issue_path(issue: GraphIssue) -> str:
    """Where a graph problem is: the graph's name, the step field, the node's steps, or the nodes."""
    if issue.field == NAME_FIELD:
        return NAME_FIELD
    if issue.node is None:
        return "spec.nodes"
    if issue.step is None:
        return f"spec.nodes[{issue.node}].steps"
    if issue.field is None:
        return f"spec.nodes[{issue.node}].steps[{issue.step}]"
    return step_path(issue.node, issue.step, issue.field)


def graph_violations(spec: Mapping[str, Any], name: str | None = None) -> list[Violation]:
    """Every problem of the graph (and of its name, when given), each at its field path; empty for a graph the
    controller would render."""
    try:
        model = InferenceGraphSpec.model_validate(spec)
    except ValidationError as error:  # the CRD's schema normally refuses these first
        return [Violation(spec_path(e["loc"]), str(e["msg"])) for e in error.errors()]
    return [Violation(issue_path(issue), issue.message) for issue in graph_issues_of(model, name)]
