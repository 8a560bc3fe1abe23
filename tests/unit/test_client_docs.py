"""docs/api-reference.md is what the models render today, and it documents every field of every CRD."""

from __future__ import annotations

from pathlib import Path

import yaml

from loom.client.docs import render

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "api-reference.md"


def test_the_reference_in_docs_is_current() -> None:
    assert REFERENCE.read_text() == render(), "docs/api-reference.md is stale: run `make docs`"


def _fields(schema: dict[str, object], out: set[str]) -> None:
    properties = schema.get("properties")
    if isinstance(properties, dict):
        for name, sub in properties.items():
            out.add(name)
            _fields(sub, out)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _fields(schema[key], out)  # type: ignore[arg-type]


def test_every_crd_field_has_a_row_in_the_reference() -> None:
    text = REFERENCE.read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    for crd_file in sorted((REPO / "crds").glob("loom.dev_*.yaml")):
        crd = yaml.safe_load(crd_file.read_text())
        root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        names: set[str] = set()
        _fields(root["properties"]["spec"], names)
        _fields(root["properties"]["status"], names)
        assert names - rows == set(), crd_file.name
