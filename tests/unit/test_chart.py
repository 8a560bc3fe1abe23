"""charts/loom without a cluster or helm: CRDs in step with crds/, values valid against the schema, the
operator settings the Deployment sets, and the RBAC invariants (no wildcard, no Secrets, a reason per rule).
Rendering with helm and the server-side dry run are in e2e/tests/test_helm_install.py (helm comes with the stack).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.operator import settings
from loom.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "loom"
TEMPLATES = CHART / "templates"


def schema_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))


def defaults() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text()))


def strip_template(text: str) -> str:
    """The template as plain YAML: directive-only lines dropped, every other action replaced by a word."""
    lines = [line for line in text.splitlines() if not re.fullmatch(r"\s*\{\{-?.*-?\}\}\s*", line)]
    return re.sub(r"\{\{-?.*?-?\}\}", "X", "\n".join(lines))


def rbac_documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(strip_template((TEMPLATES / "rbac.yaml").read_text())) if d]


def rules() -> list[dict[str, Any]]:
    return [rule for doc in rbac_documents() if doc["kind"] == "ClusterRole" for rule in doc["rules"]]


def test_chart_crds_are_the_generated_ones() -> None:
    chart = {p.name: p.read_text() for p in (CHART / "crds").glob("loom.dev_*.yaml")}
    generated = {p.name: p.read_text() for p in (REPO / "crds").glob("*.yaml")}
    assert chart == generated and len(chart) == 4
    # Besides Loom's own: Kopf's peering CRD (high availability), not generated from Loom's models.
    assert {p.name for p in (CHART / "crds").glob("*.yaml")} - set(chart) == {"kopf.dev_clusterkopfpeerings.yaml"}


def installable() -> dict[str, Any]:
    """The chart's defaults plus the one value they lack: where Loom's images are."""
    values = defaults()
    values["image"]["registry"] = "registry.example.com/loom"
    return values


def test_default_values_plus_a_registry_are_valid_and_bad_ones_are_refused() -> None:
    validator = schema_validator()
    assert list(validator.iter_errors(installable())) == []
    for bad in (
        {"logLevel": "LOUD"},
        {"settings": {"health_host": "0.0.0.0"}},  # the chart sets it; a value would be a second source
        {"settings": {"Bad-Key": 1}},
        {"image": {"registry": "registry.example.com/loom", "tag": "1.0 beta"}},
        {"metrics": {"port": 70000}},
        {"watchNamespaces": ["a", "a"]},
        {"unknown": True},
    ):
        assert list(validator.iter_errors({**installable(), **bad})), bad


def test_no_image_is_a_default_and_an_unqualified_one_is_refused() -> None:
    """Loom publishes no image: the defaults name none and are refused, as is a registry path without a host (it
    would resolve to the default public registry) or an operator repository alone (the workloads' would be unset)."""
    validator = schema_validator()
    values = defaults()
    assert all(not v for v in values["image"].values() if v != values["image"]["pullPolicy"])
    assert all(not v for image in values["workloadImages"].values() for v in image.values())
    assert list(validator.iter_errors(values))

    def errors(image: dict[str, str], workloads: dict[str, dict[str, str]] | None = None) -> list[str]:
        candidate = defaults()
        candidate["image"].update(image)
        for name, fields in (workloads or {}).items():
            candidate["workloadImages"][name].update(fields)
        return [e.message for e in validator.iter_errors(candidate)]

    for registry in ("registry.example.com/loom", "127.0.0.1:5000/loom", "localhost/loom", "reg:5000", "a.io"):
        assert errors({"registry": registry}) == [], registry
    for registry in ("loom", "loom/images", "https://registry.example.com/loom", "registry.example.com/Loom/"):
        assert errors({"registry": registry}), registry
    assert errors({"repository": "registry.example.com/loom/operator"})  # the workload images would have none
    workloads = ("trainer", "server", "router", "features", "vllm")
    named = {name: {"repository": f"registry.example.com/ml/{name}"} for name in workloads}
    assert errors({"repository": "registry.example.com/loom/operator"}, named) == []
    assert errors({"repository": "registry.example.com/loom/operator"}, {**named, "trainer": {"repository": "loom/t"}})
    assert errors({"registry": "a.io/loom", "digest": "sha256:" + "0" * 64}) == []
    assert errors({"registry": "a.io/loom", "digest": "sha256:xyz"}) and errors(
        {"registry": "a.io/loom", "digest": "0" * 64}
    )
    assert errors({"registry": "a.io/loom"}, {"server": {"digest": "sha256:" + "f" * 64}}) == []


def test_the_schema_and_the_operator_agree_on_what_a_qualified_image_is() -> None:
    """values.schema.json's registry and repository patterns are built from the operator's own host and path
    expressions (operator/settings.py), so the chart cannot render a LOOM_*_IMAGE the operator refuses."""
    definitions = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    assert definitions["registry"]["pattern"] == f"^(?:{settings._HOST}(?:/{settings._PATH})*)?$"
    assert definitions["repository"]["pattern"] == f"^(?:{settings._HOST}(?:/{settings._PATH})+)?$"
    assert definitions["tag"]["pattern"] == f"^(?:{settings._TAG[1:]})?$"
    assert definitions["digest"]["pattern"] == f"^(?:{settings._DIGEST[1:]})?$"


def test_every_loom_variable_the_deployment_sets_is_an_operator_setting() -> None:
    template = (TEMPLATES / "deployment.yaml").read_text()
    names = set(re.findall(r"name: (LOOM_[A-Z0-9_]+)", template))
    fields = {f"LOOM_{name.upper()}" for name in OperatorSettings.model_fields}
    assert names and names <= fields, names - fields
    # `settings` may set any other field, but none the template sets itself.
    reserved = json.loads((CHART / "values.schema.json").read_text())["properties"]["settings"]["propertyNames"]
    assert {f"LOOM_{n.upper()}" for n in reserved["not"]["enum"]} == names
    # In a pod the endpoints listen on the pod's address, so the kubelet's probes reach them.
    assert '{name: LOOM_HEALTH_HOST, value: "0.0.0.0"}' in template
    assert template.count("path: /healthz, port: health") == 3  # startup, readiness, liveness


def test_rbac_has_no_wildcard_and_never_names_secrets() -> None:
    found = rules()
    assert found
    for rule in found:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
        assert not any(r.split("/")[0] == "secrets" for r in rule["resources"]), rule
        assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate", "deletecollection"}, rule


def test_every_rule_says_why_it_is_there() -> None:
    lines = (TEMPLATES / "rbac.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            assert lines[i - 1].strip().startswith("#"), f"rule at line {i + 1} has no comment above it"


@pytest.mark.parametrize(
    ("group", "resource", "verbs"),
    [
        # What the current controllers and Kopf do (operator/core/client.py callers, Kopf watches and patches).
        ("loom.dev", "trainingjobs", {"get", "list", "watch", "patch"}),
        ("loom.dev", "inferenceservices/status", {"patch"}),
        ("loom.dev", "inferenceservices/scale", {"patch"}),
        ("loom.dev", "inferencegraphs/scale", {"patch"}),
        ("apps", "deployments/scale", {"patch"}),
        ("", "pods", {"list", "watch", "create", "patch", "delete"}),
        ("", "services", {"get", "create", "patch", "delete"}),
        ("", "configmaps", {"create", "patch", "delete"}),
        ("", "events", {"create"}),
        ("apps", "deployments", {"get", "list", "watch", "create", "patch", "delete"}),
        ("", "nodes", {"list", "watch"}),
        ("apiextensions.k8s.io", "customresourcedefinitions", {"list", "watch"}),
        ("kueue.x-k8s.io", "workloads", {"get", "list", "watch", "create", "patch", "delete"}),
        ("visibility.kueue.x-k8s.io", "localqueues/pendingworkloads", {"get"}),
        ("kueue.x-k8s.io", "workloads/status", {"patch"}),
        ("kueue.x-k8s.io", "resourceflavors", {"get"}),
        ("kueue.x-k8s.io", "workloadpriorityclasses", {"get"}),
        ("scheduling.k8s.io", "priorityclasses", {"get"}),
        # The picker's Lease (applied) and what its Role grants on it (the operator must hold it to grant it).
        ("coordination.k8s.io", "leases", {"get", "update", "create", "patch"}),
    ],
)
def test_the_operator_gets_what_it_uses(group: str, resource: str, verbs: set[str]) -> None:
    granted = {
        verb
        for rule in rules()
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert verbs <= granted, verbs - granted
