"""CRD generation: structural schemas, CEL rules, subresources, printer columns, and no drift from crds/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from loom.operator.api import KINDS
from loom.operator.api.crd import crd_for, render_all
from loom.operator.cli import main

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key in ("properties", "patternProperties"):
            for name, sub in node.get(key, {}).items():
                found += walk(sub, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                found += walk(node[key], f"{path}[{key}]")
        for key in ("anyOf", "oneOf", "allOf"):
            for i, sub in enumerate(node.get(key, [])):
                found += walk(sub, f"{path}<{key}{i}>")
    return found


def schema_of(kind_name: str) -> dict[str, Any]:
    kind = next(k for k in KINDS if k.kind == kind_name)
    return crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_schema_is_structural(kind: Any) -> None:
    root = crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(root):
        assert "$ref" not in node, path
        assert "title" not in node, path
        assert "const" not in node, path
        in_combinator = "<" in path.rsplit(".", 1)[-1]
        if not in_combinator and not node.get("x-kubernetes-int-or-string"):
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("type") == "null" or any(o.get("type") == "null" for o in node.get("anyOf", [])):
            pytest.fail(f"null type at {path}")
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


@pytest.mark.parametrize("folder", [CRD_DIR, REPO / "charts" / "loom" / "crds"], ids=["crds", "chart"])
def test_crds_folder_matches_models(folder: Path) -> None:
    """Drift check: the CRD files must be exactly what the models generate (`make crds` regenerates them)."""
    expected = render_all()
    # Only Loom's own: the chart's folder also carries Kopf's peering CRD (charts/loom/crds/kopf.dev_*, not generated).
    on_disk = {p.name: p.read_text() for p in sorted(folder.glob("loom.dev_*.yaml"))}
    assert on_disk == expected


def test_loom_crds_prints_the_folder() -> None:
    result = CliRunner().invoke(main, ["crds"])
    assert result.exit_code == 0, result.output
    assert result.output == "".join(p.read_text() for p in sorted(CRD_DIR.glob("*.yaml")))
    docs = [d for d in yaml.safe_load_all(result.output) if d]
    assert sorted(d["spec"]["names"]["kind"] for d in docs) == sorted(k.kind for k in KINDS)


def test_names_subresources_and_columns() -> None:
    for kind in KINDS:
        crd = crd_for(kind)
        names = crd["spec"]["names"]
        assert names["categories"] == ["loom"]
        # KServe owns isvc / ig; Kubeflow owns tfjob/pytorchjob-like names.
        assert not set(names["shortNames"]) & {"isvc", "ig", "inferenceservice", "tj", "fv"}
        version = crd["spec"]["versions"][0]
        assert version["subresources"]["status"] == {}
        assert version["additionalPrinterColumns"][-1]["name"] == "Age"
    isvc = crd_for(next(k for k in KINDS if k.kind == "InferenceService"))
    assert isvc["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    tj_columns = [c["name"] for c in crd_for(KINDS[0])["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert {"Phase", "Ready", "Desired", "Step", "Total", "Restarts", "Age"} <= set(tj_columns)


def rules(node: dict[str, Any]) -> list[str]:
    return [r["rule"] for r in node.get("x-kubernetes-validations", [])]


def test_cel_rules_present_where_fields_interact() -> None:
    tj = schema_of("TrainingJob")["properties"]["spec"]
    assert "self.engine == oldSelf.engine" in rules(tj)
    workers = tj["properties"]["workers"]
    assert any("minReplicas <= self.replicas" in r for r in rules(workers))
    assert any("replicas <= self.maxReplicas" in r for r in rules(workers))
    assert any("has(self.module) != has(self.command)" in r for r in rules(tj["properties"]["entrypoint"]))

    isvc = schema_of("InferenceService")["properties"]["spec"]
    assert any("minReplicas <= self.maxReplicas" in r for r in rules(isvc["properties"]["autoscaling"]))
    assert any("size() == 1" in r for r in rules(isvc["properties"]["model"]))
    # spec.replicas and autoscaling coexist: the autoscaler writes replicas through the scale subresource.
    assert any("has(self.query)" in r for r in rules(isvc["properties"]["autoscaling"]))
    assert any("idleSeconds" in r and "minReplicas == 0" in r for r in rules(isvc["properties"]["autoscaling"]))

    graph = schema_of("InferenceGraph")["properties"]["spec"]
    assert "'root' in self.nodes" in rules(graph)
    node = graph["properties"]["nodes"]["additionalProperties"]
    assert any(".sum() == 100" in r for r in rules(node))
    assert any("s.nodeName in self.nodes" in r for r in rules(graph))


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    for kind in KINDS:
        conditions = crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"][
            "properties"
        ]["conditions"]
        assert conditions["x-kubernetes-list-type"] == "map"
        assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_descriptions_reach_kubectl_explain() -> None:
    spec = schema_of("TrainingJob")["properties"]["spec"]["properties"]
    assert "Immutable" in spec["engine"]["description"]
    assert "s3://" in spec["checkpoint"]["properties"]["uri"]["description"]
    assert spec["checkpoint"]["properties"]["async"]["default"] is True


def test_quantities_are_int_or_string() -> None:
    limits = schema_of("TrainingJob")["properties"]["spec"]["properties"]["workers"]["properties"]["resources"][
        "properties"
    ]["limits"]["additionalProperties"]
    assert limits["x-kubernetes-int-or-string"] is True
    assert "type" not in limits
