"""RouterConfig, the operator -> router contract: its JSON form and the graph's structural checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from loom.workloads.router.config import RouterConfig, UpstreamConfig


def config(nodes: dict[str, Any], services: tuple[str, ...] = ("a", "b"), **extra: Any) -> RouterConfig:
    return RouterConfig.model_validate({
        "graphName": "g",
        "nodes": nodes,
        "services": {s: {"url": f"http://{s}.ns.svc:80", "modelName": s} for s in services},
        **extra,
    })


def problems(nodes: dict[str, Any], services: tuple[str, ...] = ("a", "b")) -> str:
    with pytest.raises(ValidationError) as caught:
        config(nodes, services)
    return str(caught.value)


def test_round_trips_through_its_configmap_json(tmp_path: Path) -> None:
    original = config(
        {"root": {"routerType": "Sequence", "steps": [
            {"serviceName": "a", "dependency": "Hard", "timeoutMs": 500},
            {"nodeName": "pick", "data": "$response"}]},
         "pick": {"routerType": "Splitter", "steps": [
             {"serviceName": "a", "weight": 30}, {"serviceName": "b", "weight": 70}]}},
        stepTimeoutMs=1000, deadlineMs=5000,
    )
    doc = json.loads(original.to_json())
    assert doc["graphName"] == "g" and doc["deadlineMs"] == 5000 and doc["stepTimeoutMs"] == 1000
    assert doc["services"]["a"] == {"url": "http://a.ns.svc:80", "modelName": "a"}
    assert doc["nodes"]["root"]["steps"][0]["timeoutMs"] == 500
    path = tmp_path / "router.json"
    path.write_text(original.to_json())
    loaded = RouterConfig.from_file(path)
    assert loaded == original
    assert loaded.step_timeout_s(loaded.nodes["root"].steps[0]) == 0.5
    assert loaded.step_timeout_s(loaded.nodes["root"].steps[1]) == 1.0


def test_defaults_match_the_api() -> None:
    step = config({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}).nodes["root"].steps[0]
    assert (step.data, step.dependency, step.label) == ("$request", "Soft", "a")


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ({"first": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}, "a node named 'root'"),
        ({"root": {"routerType": "Sequence", "steps": [{"nodeName": "nope"}]}},
         "node 'root' step 0 (nope): nodeName 'nope' is not a node of this graph"),
        ({"root": {"routerType": "Sequence", "steps": [{"serviceName": "c"}]}},
         "serviceName 'c' has no entry in services"),
        ({"root": {"routerType": "Splitter", "steps": [
            {"serviceName": "a", "weight": 50}, {"serviceName": "b", "weight": 40}]}},
         "Splitter weights must sum to 100, they sum to 90"),
        ({"root": {"routerType": "Splitter", "steps": [{"serviceName": "a", "weight": 100}, {"serviceName": "b"}]}},
         "every Splitter step needs a weight"),
        ({"root": {"routerType": "Splitter", "steps": [
            {"serviceName": "a", "weight": 100, "condition": "true"}]}}, "a Splitter step takes no condition"),
        ({"root": {"routerType": "Switch", "steps": [{"serviceName": "a", "weight": 100}]}},
         "weight only applies to Splitter steps"),
        ({"root": {"routerType": "Ensemble", "steps": [{"serviceName": "a"}, {"serviceName": "a"}]}},
         "Ensemble step names must be unique (they name the outputs), repeated: a"),
        ({"root": {"routerType": "Sequence", "steps": [{"nodeName": "x"}]},
          "x": {"routerType": "Sequence", "steps": [{"nodeName": "y"}]},
          "y": {"routerType": "Switch", "steps": [{"nodeName": "x"}]}},
         "nodes form a cycle: x -> y -> x"),
        ({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a", "nodeName": "root"}]}},
         "set exactly one of serviceName or nodeName"),
        ({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a", "name": "has space"}]}},
         "step name must be"),
        ({"root": {"routerType": "Loop", "steps": [{"serviceName": "a"}]}}, "routerType"),
        ({"root": {"routerType": "Sequence", "steps": []}}, "at least 1 item"),
    ],
)
def test_a_bad_graph_is_refused_with_a_message_naming_the_place(nodes: dict[str, Any], message: str) -> None:
    assert message in problems(nodes)


def test_every_problem_is_reported_at_once() -> None:
    text = problems({"root": {"routerType": "Sequence", "steps": [{"nodeName": "nope"}, {"serviceName": "c"}]}})
    assert "nodeName 'nope'" in text and "serviceName 'c'" in text


def test_a_self_reference_is_a_cycle() -> None:
    assert "nodes form a cycle: root -> root" in problems(
        {"root": {"routerType": "Sequence", "steps": [{"nodeName": "root"}]}}
    )


def test_ensemble_names_can_be_made_unique_with_name() -> None:
    built = config({"root": {"routerType": "Ensemble", "steps": [
        {"serviceName": "a", "name": "first"}, {"serviceName": "a", "name": "second"}]}})
    assert [s.label for s in built.nodes["root"].steps] == ["first", "second"]


@pytest.mark.parametrize("url", ["a.ns.svc", "http://a.ns.svc/v2", "ftp://a", "http://"])
def test_upstream_url_is_a_base_url(url: str) -> None:
    with pytest.raises(ValidationError, match="url must be"):
        UpstreamConfig(url=url, model_name="a")


def test_upstream_url_trailing_slash_is_dropped() -> None:
    assert UpstreamConfig(url="http://a.ns.svc:8080/", model_name="a").url == "http://a.ns.svc:8080"


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="extra"):
        config({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}, timeout=3)
