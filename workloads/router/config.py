"""The router's configuration: the contract between the operator and the router pod.

The operator renders a ``RouterConfig`` from an InferenceGraph (and the InferenceServices it names)
into the router's ConfigMap (JSON, camelCase); the router reads it back with
:meth:`RouterConfig.from_file`. This module imports pydantic only, so the operator can use it
without starlette, aiohttp or the CEL library installed.

The structural checks of a graph (root exists, references resolve, no cycles, Splitter weights,
unique Ensemble step names) run when the model is built; :func:`graph_problems` returns them as a
list of readable messages so the controller can report them as a condition. Compiling the CEL
conditions needs the CEL library and lives in :mod:`loom.workloads.router.conditions`.

Secrets never travel through this object: the router forwards the caller's API key to the steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from loom.workloads.common.body_limit import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT_S

RouterType = Literal["Sequence", "Switch", "Ensemble", "Splitter"]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
ROOT = "root"


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class UpstreamConfig(_Camel):
    """One InferenceService as the router reaches it."""

    url: str = Field(description="Base URL of the service, e.g. http://classifier.team.svc:80 (no path).")
    model_name: str = Field(description="The model name the service serves under /v2/models/{name}.")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", value):
            raise ValueError(f"url must be http(s)://host[:port] without a path, got {value!r}")
        return value.rstrip("/")

    @field_validator("model_name")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if not _MODEL_NAME.match(value):
            raise ValueError("modelName must be 1-128 characters of letters, digits, '_', '.', '-'")
        return value


class StepConfig(_Camel):
    """One step of a node: call an InferenceService (``serviceName``) or another node (``nodeName``)."""

    name: str | None = Field(None, description="Step name: its key in an Ensemble, its label in metrics.")
    service_name: str | None = Field(None, description="Key into RouterConfig.services.")
    node_name: str | None = Field(None, description="Another node of this graph.")
    data: Literal["$request", "$response"] = "$request"
    condition: str | None = Field(
        None, description="CEL over `request` (the graph's request) and `response` (this node's input)."
    )
    weight: int | None = Field(None, ge=0, le=100, description="Splitter: percent of traffic.")
    dependency: Literal["Soft", "Hard"] = "Soft"
    timeout_ms: int | None = Field(None, ge=1, le=3_600_000, description="Overrides stepTimeoutMs.")

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
        return self

    @property
    def label(self) -> str:
        """The step's name: ``name``, else the service or node it calls."""
        return self.name or self.service_name or self.node_name or "?"


class NodeConfig(_Camel):
    router_type: RouterType
    steps: list[StepConfig] = Field(min_length=1, max_length=32)


class RouterConfig(_Camel):
    """Everything the router needs to execute one InferenceGraph and serve it as an OIP v2 model."""

    graph_name: str = Field(description="The model name clients use: /v2/models/{graphName}/infer.")
    nodes: dict[str, NodeConfig] = Field(min_length=1, description="Execution starts at 'root'.")
    services: dict[str, UpstreamConfig] = Field(
        default_factory=dict, description="Every InferenceService a step names, by serviceName."
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

    @field_validator("graph_name")
    @classmethod
    def _check_graph_name(cls, value: str) -> str:
        if not _MODEL_NAME.match(value):
            raise ValueError("graphName must be 1-128 characters of letters, digits, '_', '.', '-'")
        return value

    @model_validator(mode="after")
    def _check_graph(self) -> RouterConfig:
        problems = graph_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def step_timeout_s(self, step: StepConfig) -> float:
        return (step.timeout_ms or self.step_timeout_ms) / 1000.0

    @classmethod
    def from_file(cls, path: str | Path) -> RouterConfig:
        return cls.model_validate(json.loads(Path(path).read_text()))

    def to_json(self) -> str:
        """The ConfigMap form: camelCase, defaults included so the pod sees exactly what was rendered."""
        return self.model_dump_json(by_alias=True, indent=2)


def graph_problems(config: RouterConfig) -> list[str]:
    """Structural problems of the graph, each a message naming the node and step; empty when sound."""
    problems: list[str] = []
    if ROOT not in config.nodes:
        problems.append(f"nodes must contain a node named {ROOT!r}")
    for node_name, node in config.nodes.items():
        where = f"node {node_name!r}"
        for index, step in enumerate(node.steps):
            at = f"{where} step {index} ({step.label})"
            if step.node_name is not None and step.node_name not in config.nodes:
                problems.append(f"{at}: nodeName {step.node_name!r} is not a node of this graph")
            if step.service_name is not None and step.service_name not in config.services:
                problems.append(f"{at}: serviceName {step.service_name!r} has no entry in services")
            if node.router_type == "Splitter":
                if step.weight is None:
                    problems.append(f"{at}: every Splitter step needs a weight")
                if step.condition is not None:
                    problems.append(f"{at}: a Splitter step takes no condition (the weights choose)")
            elif step.weight is not None:
                problems.append(f"{at}: weight only applies to Splitter steps")
        if node.router_type == "Splitter" and all(s.weight is not None for s in node.steps):
            total = sum(s.weight or 0 for s in node.steps)
            if total != 100:
                problems.append(f"{where}: Splitter weights must sum to 100, they sum to {total}")
        if node.router_type == "Ensemble":
            labels = [s.label for s in node.steps]
            dupes = sorted({label for label in labels if labels.count(label) > 1})
            if dupes:
                problems.append(
                    f"{where}: Ensemble step names must be unique (they name the outputs), repeated: "
                    + ", ".join(dupes) + "; set `name` on the steps"
                )
    cycle = _find_cycle(config)
    if cycle:
        problems.append("nodes form a cycle: " + " -> ".join(cycle))
    return problems


def _find_cycle(config: RouterConfig) -> list[str] | None:
    """A cycle of node references (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for step in config.nodes[name].steps:
            target = step.node_name
            if target is None or target not in config.nodes:
                continue
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[name] = 2
        return None

    for name in config.nodes:
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None
