"""InferenceGraph rendering: the RouterConfig built from the spec and the observed InferenceServices, the router's
ConfigMap / Deployment / Service, and the problems admission cannot catch reported instead of rendered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.operator.kinds.inferencegraph.api import InferenceGraphSpec
from loom.operator.kinds.inferencegraph.render import (
    CONFIG_FILE,
    ServiceRef,
    config_map_name,
    deployment_name,
    hard_services,
    observe_service,
    referenced_services,
    render_router,
    router_config,
)
from loom.operator.kinds.inferenceservice.render import CONFIG_HASH_ANNOTATION
from loom.workloads.router.config import RouterConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OWNER = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "InferenceGraph",
    "metadata": {"name": "bot", "namespace": "team", "uid": "uid-1", "generation": 3},
}


def isvc(name: str, *, ready: bool = True, model_name: str | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"uri": "s3://b/m"}
    if model_name:
        model["name"] = model_name
    status = "True" if ready else "False"
    return {
        "metadata": {"name": name, "namespace": "team"},
        "spec": {"model": model},
        "status": {"conditions": [{"type": "Ready", "status": status, "reason": "Serving" if ready else "Loading"}]},
    }


def refs(*names: str) -> dict[str, ServiceRef]:
    return {n: observe_service(isvc(n)) for n in names}


def spec(nodes: dict[str, Any], **router: Any) -> InferenceGraphSpec:
    return InferenceGraphSpec.model_validate({"nodes": nodes, "router": router})


SEQUENCE = {
    "root": {
        "routerType": "Sequence",
        "steps": [
            {"name": "classify", "serviceName": "classifier", "dependency": "Hard"},
            {"nodeName": "route", "data": "$response"},
        ],
    },
    "route": {
        "routerType": "Switch",
        "steps": [
            {"serviceName": "billing", "data": "$request", "condition": "response.outputs[0].data[0] == 'billing'"},
            {"serviceName": "general", "data": "$request"},
        ],
    },
}


def test_observed_service_url_model_name_and_readiness() -> None:
    ref = observe_service(isvc("classifier", model_name="clf-v2", ready=False))
    assert ref == ServiceRef("classifier", "http://classifier.team.svc:80", "clf-v2", ready=False, reason="Loading")
    assert observe_service(isvc("general")).model_name == "general"  # no spec.model.name: the service's name


def test_router_config_by_keyword_from_spec_and_services() -> None:
    graph = spec(SEQUENCE, timeoutMs=1500)
    assert referenced_services(graph) == ["billing", "classifier", "general"]
    assert hard_services(graph) == {"classifier"}
    config, problem = router_config(OWNER, graph, refs("classifier", "billing", "general"))
    assert problem is None and config is not None
    assert config.graph_name == "bot"
    assert config.step_timeout_ms == 1500 and config.deadline_ms == 60_000
    assert config.services["billing"].url == "http://billing.team.svc:80"
    assert config.services["billing"].model_name == "billing"
    route = config.nodes["route"]
    assert route.router_type == "Switch"
    assert route.steps[0].condition == "response.outputs[0].data[0] == 'billing'"
    assert [s.data for s in route.steps] == ["$request", "$request"]
    assert config.nodes["root"].steps[0].dependency == "Hard"
    # The ConfigMap form reads back as the same contract (what the router pod will load).
    assert RouterConfig.model_validate(json.loads(config.to_json())) == config


def test_a_long_step_timeout_raises_the_overall_deadline() -> None:
    config, _ = router_config(OWNER, spec(SEQUENCE, timeoutMs=120_000), refs("classifier", "billing", "general"))
    assert config is not None and config.deadline_ms == 120_000


def test_missing_services_wait_with_service_not_found() -> None:
    config, problem = router_config(OWNER, spec(SEQUENCE), refs("classifier"))
    assert config is None and problem is not None
    assert problem.reason == "ServiceNotFound"
    assert problem.message == "InferenceService(s) not found: billing, general"


def test_a_cycle_is_an_invalid_graph_naming_the_path() -> None:
    nodes = {
        "root": {"routerType": "Sequence", "steps": [{"nodeName": "a"}]},
        "a": {"routerType": "Sequence", "steps": [{"nodeName": "root"}]},
    }
    config, problem = router_config(OWNER, spec(nodes), {})
    assert config is None and problem is not None
    assert problem.reason == "InvalidGraph"
    assert "nodes form a cycle: root -> a -> root" in problem.message


def test_a_condition_that_does_not_compile_is_reported_before_missing_services() -> None:
    nodes = {
        "root": {
            "routerType": "Switch",
            "steps": [
                {"serviceName": "a", "condition": "request.inputs[0].data[0] >"},
                {"serviceName": "b", "condition": "reqest.x == 1"},
            ],
        }
    }
    config, problem = router_config(OWNER, spec(nodes), {})
    assert config is None and problem is not None
    assert problem.reason == "InvalidGraph"
    assert "node 'root' step 0 (a): condition 'request.inputs[0].data[0] >'" in problem.message
    assert "unknown variable(s) reqest" in problem.message


def test_structural_problems_admission_cannot_see() -> None:
    nodes = {
        "root": {
            "routerType": "Ensemble",
            "steps": [{"serviceName": "a", "weight": 50}, {"serviceName": "a"}],
        }
    }
    config, problem = router_config(OWNER, spec(nodes), refs("a"))
    assert config is None and problem is not None and problem.reason == "InvalidGraph"
    assert "weight only applies to Splitter steps" in problem.message
    assert "Ensemble step names must be unique" in problem.message


def test_a_step_name_the_router_refuses_is_an_invalid_graph() -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [{"name": "has space", "serviceName": "a"}]}}
    config, problem = router_config(OWNER, spec(nodes), refs("a"))
    assert config is None and problem is not None and problem.reason == "InvalidGraph"
    assert "step name" in problem.message


def children(graph: InferenceGraphSpec, services: dict[str, ServiceRef]) -> tuple[Any, Any, Any]:
    config, problem = router_config(OWNER, graph, services)
    assert config is not None, problem
    config_map, deployment, service = render_router(OWNER, graph, config, "loom/server:test")
    return config_map, deployment, service


def test_router_children_names_owner_labels_and_command() -> None:
    config_map, deployment, service = children(spec(SEQUENCE, replicas=3), refs("classifier", "billing", "general"))
    assert (config_map["kind"], deployment["kind"], service["kind"]) == ("ConfigMap", "Deployment", "Service")
    assert config_map["metadata"]["name"] == config_map_name("bot") == "bot-router-config"
    assert deployment["metadata"]["name"] == deployment_name("bot") == "bot-router"
    assert service["metadata"]["name"] == "bot"  # the graph's URL: http://bot.team.svc
    for child in (config_map, deployment, service):
        assert child["metadata"]["namespace"] == "team"
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceGraph", "bot", "uid-1", True)
        assert child["metadata"]["labels"]["loom.dev/inferencegraph"] == "bot"
        assert child["metadata"]["labels"]["app.kubernetes.io/component"] == "router"

    assert json.loads(config_map["data"][CONFIG_FILE])["graphName"] == "bot"
    dspec = deployment["spec"]
    assert dspec["replicas"] == 3
    assert dspec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    template = dspec["template"]
    assert set(dspec["selector"]["matchLabels"].items()) <= set(template["metadata"]["labels"].items())
    assert service["spec"]["selector"] == dspec["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    (container,) = template["spec"]["containers"]
    assert container["image"] == "loom/server:test"
    assert container["command"][:5] == ["python", "-m", "loom.workloads.router", "--config", "/etc/loom/router.json"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert template["spec"]["volumes"] == [{"name": "config", "configMap": {"name": "bot-router-config"}}]


def test_a_graph_change_rolls_the_router_and_only_then() -> None:
    services = refs("classifier", "billing", "general")
    _, before, _ = children(spec(SEQUENCE), services)
    _, same, _ = children(spec(SEQUENCE), services)
    changed_nodes = json.loads(json.dumps(SEQUENCE))
    changed_nodes["route"]["steps"][0]["condition"] = "response.outputs[0].data[0] == 'invoices'"
    _, after, _ = children(spec(changed_nodes), services)
    renamed = dict(services, general=observe_service(isvc("general", model_name="general-v2")))
    _, remodelled, _ = children(spec(SEQUENCE), renamed)

    def config_hash(deployment: dict[str, Any]) -> str:
        return str(deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])

    assert config_hash(before) == config_hash(same)
    assert config_hash(after) != config_hash(before)
    assert config_hash(remodelled) != config_hash(before)  # a service now serves another model name
    # Readiness of a service is not part of the config: it must not restart the router.
    flapping = dict(services, general=observe_service(isvc("general", ready=False)))
    assert config_hash(children(spec(SEQUENCE), flapping)[1]) == config_hash(before)


def test_the_spec_image_wins_over_the_operator_default() -> None:
    _, deployment, _ = children(spec(SEQUENCE, image="my/router:1"), refs("classifier", "billing", "general"))
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "my/router:1"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("inferencegraph-*.yaml")), ids=lambda p: p.name)
def test_examples_render_once_their_services_exist(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    graph = InferenceGraphSpec.model_validate(doc["spec"])
    owner = {**OWNER, "metadata": {**OWNER["metadata"], "name": doc["metadata"]["name"]}}  # type: ignore[dict-item]
    config, problem = router_config(owner, graph, {})
    assert config is None and problem is not None and problem.reason == "ServiceNotFound"
    config, problem = router_config(owner, graph, refs(*referenced_services(graph)))
    assert problem is None and config is not None
    assert config.graph_name == doc["metadata"]["name"]


def test_openai_chat_steps_render_into_a_chat_graph_and_a_mixed_graph_is_invalid() -> None:
    chat = {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "drafter", "protocol": "openai-chat"},
        {"serviceName": "editor", "protocol": "openai-chat", "data": "$response"},
    ]}}
    config, problem = router_config(OWNER, spec(chat), refs("drafter", "editor"))
    assert problem is None and config is not None
    assert config.protocol == "openai-chat"
    assert [s.protocol for s in config.nodes["root"].steps] == ["openai-chat", "openai-chat"]
    mixed = {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "drafter", "protocol": "openai-chat"}, {"serviceName": "editor", "data": "$response"},
    ]}}
    config, problem = router_config(OWNER, spec(mixed), refs("drafter", "editor"))
    assert config is None and problem is not None and problem.reason == "InvalidGraph"
    assert "node 'root' step 1 (editor): one graph speaks one protocol" in problem.message
