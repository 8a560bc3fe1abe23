"""The router's configuration: the contract between the operator and the router pod.

The operator renders a ``RouterConfig`` from an InferenceGraph (and the InferenceServices it names)
into the router's ConfigMap (JSON, camelCase); the router reads it back with
:meth:`RouterConfig.from_file`. This module imports pydantic only, so the operator can use it
without starlette, aiohttp or the CEL library installed.

The structural checks of a graph (root exists, references resolve, no cycles, Splitter weights,
unique Ensemble step names) run when the model is built; :func:`graph_issues` returns them with their
place (node, step, field), :func:`graph_problems` as readable messages: the controller reports those as a
condition, the operator's admission webhook refuses the same problems with their field paths (one source).
Compiling the CEL conditions needs the CEL library and lives in :mod:`loom.workloads.router.conditions`.

Secrets never travel through this object: the router forwards the caller's API key to the steps.
"""

from __future__ import annotations

import graphlib
import re
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from loom.workloads.common.body_limit import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT_S
from loom.workloads.common.config import CamelModel, WorkloadConfig
from loom.workloads.common.model_name import ModelName, model_name

from .retrieval_config import RetrieveConfig, VectorStoreConfig

# ------------------------------------------------------------------------------------------- shared vocabulary
# What an InferenceGraph's nodes and steps also declare is written here, once; the operator's API
# (loom.operator.kinds.inferencegraph.api) imports it, and tests/unit/test_contracts.py fails if the two drift apart.
RouterType = Literal["Sequence", "Switch", "Ensemble", "Splitter"]
Protocol = Literal["oip-v2", "openai-chat"]
# A step's input: the graph's request or the previous step's response.
StepData = Literal["$request", "$response"]
# Hard: a failure of the step fails the graph; Soft: its node goes on without it (README: Dependencies).
Dependency = Literal["Soft", "Hard"]
SplitterWeight = Annotated[int, Field(ge=0, le=100)]
# The graph is served as a model of this name (its clients' /v2/models/{graphName}/infer).
GraphName = Annotated[str, model_name("graphName")]
# Fields of OIP v2 bodies that an OpenAI chat body never has: a condition of an openai-chat graph that reads one
# would fail on every request (condition_error), so the graph is refused before it runs.
_OIP_FIELDS = re.compile(r"\.(inputs|outputs|text_input|text_output)\b")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ROOT = "root"


class UpstreamConfig(CamelModel):
    """One InferenceService as the router reaches it."""

    url: str = Field(description="Base URL of the service, e.g. http://classifier.team.svc:80 (no path).")
    model_name: ModelName = Field(description="The model name the service serves under /v2/models/{name}.")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", value):
            raise ValueError(f"url must be http(s)://host[:port] without a path, got {value!r}")
        return value.rstrip("/")


class StepConfig(CamelModel):
    """One step of a node: call an InferenceService (``serviceName``) or another node (``nodeName``)."""

    name: str | None = Field(None, description="Step name: its key in an Ensemble, its label in metrics.")
    service_name: str | None = Field(None, description="Key into RouterConfig.services.")
    node_name: str | None = Field(None, description="Another node of this graph.")
    data: StepData = "$request"
    condition: str | None = Field(
        None, description="CEL over `request` (the graph's request) and `response` (this node's input)."
    )
    weight: SplitterWeight | None = Field(None, description="Splitter: percent of traffic.")
    dependency: Dependency = "Soft"
    timeout_ms: int | None = Field(None, ge=1, le=3_600_000, description="Overrides stepTimeoutMs.")
    protocol: Protocol | None = Field(
        None, description="oip-v2 (the default) or openai-chat: POST /v1/chat/completions of the service."
    )
    retrieve: RetrieveConfig | None = Field(
        None, description="Retrieval-augmented generation: documents put into the prompt (retrieval_config.py)."
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME.match(value):
            raise ValueError("step name must be 1-63 characters of letters, digits, '_', '.', '-'")
        return value

    @model_validator(mode="after")
    def _one_target(self) -> StepConfig:
        if (self.service_name is None) == (self.node_name is None):
            raise ValueError("set exactly one of serviceName or nodeName")
        if self.protocol is not None and self.node_name is not None:
            raise ValueError("protocol applies to serviceName steps (a nodeName step speaks its node's protocol)")
        if self.retrieve is not None and self.protocol != "openai-chat":
            raise ValueError("retrieve applies to steps with protocol openai-chat (it writes the chat prompt)")
        return self

    @property
    def label(self) -> str:
        """The step's name: ``name``, else the service or node it calls."""
        return self.name or self.service_name or self.node_name or "?"


class NodeConfig(CamelModel):
    router_type: RouterType
    steps: list[StepConfig] = Field(min_length=1, max_length=32)


class RouterConfig(WorkloadConfig):
    """Everything the router needs to execute one InferenceGraph and serve it as an OIP v2 model."""

    json_indent: ClassVar[int | None] = 2

    graph_name: GraphName = Field(description="The model name clients use: /v2/models/{graphName}/infer.")
    nodes: dict[str, NodeConfig] = Field(min_length=1, description="Execution starts at 'root'.")
    services: dict[str, UpstreamConfig] = Field(
        default_factory=dict, description="Every InferenceService a step names, by serviceName."
    )
    stores: dict[str, VectorStoreConfig] = Field(
        default_factory=dict, description="Every vector FeatureView a retrieve step names, by featureView."
    )
    step_timeout_ms: int = Field(30_000, ge=1, le=3_600_000, description="Default per-step timeout.")
    deadline_ms: int = Field(
        60_000, ge=1, le=3_600_000,
        description="Overall budget of one request (for a stream: until its first event arrives).",
    )
    max_connections: int = Field(100, ge=1, le=10_000, description="Pooled connections per upstream.")
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1024, description="Larger request bodies are refused with 413."
    )
    request_body_timeout_s: float = Field(
        DEFAULT_REQUEST_BODY_TIMEOUT_S, gt=0, le=3600, description="A body not received within this gets 408."
    )
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _check_graph(self) -> RouterConfig:
        problems = graph_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def protocol(self) -> Protocol:
        """What the graph's own entry speaks: openai-chat when its steps call services that way, else oip-v2
        (`graph_issues` refuses a graph that mixes the two)."""
        steps = [step for node in self.nodes.values() for step in node.steps]
        return "openai-chat" if any(step.protocol == "openai-chat" for step in steps) else "oip-v2"

    def step_timeout_s(self, step: StepConfig) -> float:
        return (step.timeout_ms or self.step_timeout_ms) / 1000.0


@dataclass(frozen=True)
class GraphIssue:
    """One structural problem of a graph and where it is: the node, the step index and the step field (wire
    name) it concerns, each None where it is about the node's steps together or the whole graph. ``str()`` is
    the message the controller's status shows (it names the place in words); the admission webhook turns the
    place into a field path (``spec.nodes[<node>].steps[<i>].<field>``) and shows ``message``."""

    message: str
    node: str | None = None
    step: int | None = None
    field: str | None = None
    where: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


def graph_problems(config: RouterConfig) -> list[str]:
    """Structural problems of the graph, each a message naming the node and step; empty when sound."""
    return [str(issue) for issue in graph_issues(config)]


def graph_issues(config: RouterConfig) -> list[GraphIssue]:
    """Structural problems of the graph, each with its place; empty when sound."""
    problems: list[GraphIssue] = []
    if ROOT not in config.nodes:
        problems.append(GraphIssue(f"nodes must contain a node named {ROOT!r}"))
    for node_name, node in config.nodes.items():
        where = f"node {node_name!r}"
        for index, step in enumerate(node.steps):
            at = f"{where} step {index} ({step.label})"
            found: list[tuple[str, str]] = []  # (step field, message)
            if step.node_name is not None and step.node_name not in config.nodes:
                found.append(("nodeName", f"nodeName {step.node_name!r} is not a node of this graph"))
            if step.service_name is not None and step.service_name not in config.services:
                found.append(("serviceName", f"serviceName {step.service_name!r} has no entry in services"))
            if step.retrieve is not None and step.retrieve.feature_view not in config.stores:
                found.append(("retrieve", f"featureView {step.retrieve.feature_view!r} has no entry in stores"))
            if node.router_type == "Splitter":
                if step.weight is None:
                    found.append(("weight", "every Splitter step needs a weight"))
                if step.condition is not None:
                    found.append(("condition", "a Splitter step takes no condition (the weights choose)"))
            elif step.weight is not None:
                found.append(("weight", "weight only applies to Splitter steps"))
            problems.extend(GraphIssue(message, node_name, index, field, at) for field, message in found)
        if node.router_type == "Splitter" and all(s.weight is not None for s in node.steps):
            total = sum(s.weight or 0 for s in node.steps)
            if total != 100:
                problems.append(
                    GraphIssue(f"Splitter weights must sum to 100, they sum to {total}", node_name, where=where)
                )
        if node.router_type == "Ensemble":
            labels = [s.label for s in node.steps]
            dupes = sorted({label for label in labels if labels.count(label) > 1})
            if dupes:
                problems.append(GraphIssue(
                    "Ensemble step names must be unique (they name the outputs), repeated: "
                    + ", ".join(dupes) + "; set `name` on the steps",
                    node_name, where=where,
                ))  # fmt: skip
    problems.extend(_protocol_issues(config))
    cycle = find_cycle(config)
    if cycle is not None:
        path, index = cycle
        problems.append(
            GraphIssue(
                "nodes form a cycle: " + " -> ".join(path) + "; a step may not call a node that leads back to it",
                path[-2], index, "nodeName",
            )
        )
    return problems


def _protocol_issues(config: RouterConfig) -> list[GraphIssue]:
    """One graph speaks one protocol: its entry answers what its steps answer, and a step's output is the next
    step's input, so OIP and OpenAI chat steps cannot be chained or combined. Among openai-chat graphs an Ensemble
    has no defined combined chat answer, and a condition must read fields a chat body has."""
    found: list[GraphIssue] = []
    service_steps = [
        (node_name, index, step)
        for node_name, node in config.nodes.items()
        for index, step in enumerate(node.steps)
        if step.service_name is not None
    ]
    chat = [item for item in service_steps if item[2].protocol == "openai-chat"]
    if not chat:
        return found
    for node_name, index, step in service_steps:
        if step.protocol != "openai-chat":
            found.append(GraphIssue(
                "one graph speaks one protocol: this step is oip-v2 (the default) while "
                f"{chat[0][2].label!r} of node {chat[0][0]!r} is openai-chat; set protocol: openai-chat on every "
                "serviceName step, or split the graph",
                node_name, index, "protocol", f"node {node_name!r} step {index} ({step.label})",
            ))  # fmt: skip
    for node_name, node in config.nodes.items():
        if node.router_type == "Ensemble":
            found.append(GraphIssue(
                "an Ensemble has no combined OpenAI chat answer: use a Sequence, Switch or Splitter in an "
                "openai-chat graph", node_name, where=f"node {node_name!r}",
            ))  # fmt: skip
        for index, step in enumerate(node.steps):
            match = _OIP_FIELDS.search(step.condition or "")
            if match:
                found.append(GraphIssue(
                    f"condition reads {match.group(1)!r}, an OIP v2 field that an OpenAI chat body lacks; in an "
                    "openai-chat graph `request` is the chat request (e.g. size(request.messages) > 1, "
                    "request.messages[0].content.contains('x')) and `response` a chat completion "
                    "(response.choices[0].message.content)",
                    node_name, index, "condition", f"node {node_name!r} step {index} ({step.label})",
                ))  # fmt: skip
    return found


def find_cycle(config: RouterConfig) -> tuple[list[str], int] | None:
    """A cycle of node calls, or None: as a path that ends where it starts, told from ``root`` when it is on the
    cycle, else from the smallest name (map keys have no order, so the report must not depend on it), and the
    index of the step of ``path[-2]`` that closes it by calling ``path[-1]``."""
    calls: dict[str, set[str]] = {name: set() for name in config.nodes}
    for name, node in config.nodes.items():
        for step in node.steps:
            if step.node_name is not None and step.node_name in config.nodes:  # a dangling name is reported above
                calls[name].add(step.node_name)
    try:
        # graphlib reads the mapping as node -> its predecessors: a callee comes "before" its caller.
        graphlib.TopologicalSorter(calls).prepare()
    except graphlib.CycleError as error:
        # args[1] lists nodes each of which the next one calls, ending where it started: reversed, the calls.
        cycle: list[str] = list(reversed(error.args[1]))
        start = min(range(len(cycle) - 1), key=lambda i: (cycle[i] != ROOT, cycle[i]))
        path = [*cycle[start:-1], *cycle[:start], cycle[start]]
        caller, callee = path[-2], path[-1]
        index = next(i for i, step in enumerate(config.nodes[caller].steps) if step.node_name == callee)
        return path, index
    return None
