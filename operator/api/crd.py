"""CRD generation: pydantic JSON Schema -> structural OpenAPI v3 schema -> CustomResourceDefinition.

The models are the single source of truth. Kubernetes accepts only *structural* schemas: no $ref, a type on
every node, no `additionalProperties` beside `properties`, no null types. This module rewrites pydantic's
output into that shape without losing descriptions, defaults, enums, ranges, patterns or CEL rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..core.model import GROUP, VERSION
from .kinds import KINDS, Kind

Schema = dict[str, Any]

# Keys that JSON Schema allows but a CRD's OpenAPI v3 subset does not.
_DROPPED_KEYS = {"title", "$defs", "examples", "const", "discriminator"}


def _resolve(node: Any, defs: Schema) -> Any:
    """Inline every $ref and unwrap pydantic's single-element allOf wrappers."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _resolve(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **_resolve(siblings, defs)}
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = _resolve(node["allOf"][0], defs)
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return {**inner, **_resolve(rest, defs)}
    return {key: _resolve(value, defs) for key, value in node.items()}


def _drop_null(node: Schema) -> Schema:
    """`X | None` becomes X: Loom never writes nulls (unset fields are omitted)."""
    options = node.get("anyOf")
    if not options:
        return node
    non_null = [opt for opt in options if opt.get("type") != "null"]
    if len(non_null) == len(options):
        return node
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    if len(non_null) == 1:
        return {**non_null[0], **rest}
    return {**rest, "anyOf": non_null}


def structural(node: Any) -> Any:
    """Rewrite a resolved JSON Schema node into a structural OpenAPI v3 node."""
    if isinstance(node, list):
        return [structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = _drop_null(node)
    out: Schema = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "default" and value is None:
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: structural(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "not"):
            out[key] = structural(value)
        else:
            out[key] = value
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in out and not isinstance(out["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = out["exclusiveMinimum"], True
    if "exclusiveMaximum" in out and not isinstance(out["exclusiveMaximum"], bool):
        out["maximum"], out["exclusiveMaximum"] = out["exclusiveMaximum"], True
    if "properties" in out:
        out.pop("additionalProperties", None)
        out.setdefault("type", "object")
    if out.get("additionalProperties") is False:
        out.pop("additionalProperties")
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if "enum" in out and "type" not in out:
        out["type"] = _enum_type(out["enum"])
    if out.get("type") == "array" and isinstance(out.get("items"), dict):
        item_props = out["items"].get("properties", {})
        # Conditions are a map keyed by type (Kubernetes convention): SSA merges them per type.
        if "type" in item_props and "reason" in item_props and "lastTransitionTime" in item_props:
            out["x-kubernetes-list-type"] = "map"
            out["x-kubernetes-list-map-keys"] = ["type"]
    return out


def _enum_type(values: list[Any]) -> str:
    if all(isinstance(v, bool) for v in values):
        return "boolean"
    if all(isinstance(v, int) for v in values):
        return "integer"
    return "string"


def model_schema(model: type[Any]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return structural(_resolve(raw, defs))  # type: ignore[no-any-return]


def crd_for(kind: Kind) -> Schema:
    spec_schema = model_schema(kind.spec)
    status_schema = model_schema(kind.status)
    root: Schema = {
        "type": "object",
        "description": (kind.model.__doc__ or kind.kind).strip(),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        # Only a root rule may read metadata.name.
        "x-kubernetes-validations": [{"rule": kind.name_rule.cel, "message": kind.name_rule.message}],
    }
    subresources: Schema = {"status": {}}
    if kind.scale:
        subresources["scale"] = {
            "specReplicasPath": kind.scale_replicas_path,
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    columns = []
    for col in kind.columns:
        entry: Schema = {"name": col.name, "type": col.type, "jsonPath": col.json_path}
        if col.priority:
            entry["priority"] = col.priority
        if col.description:
            entry["description"] = col.description
        columns.append(entry)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{kind.plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "loom", "app.kubernetes.io/part-of": "loom"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short_names),
                "categories": list(kind.categories),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


HEADER = "---\n# GENERATED by `loom crds` from operator/api (pydantic models). Do not edit by hand.\n"


def render_yaml(kind: Kind) -> str:
    return HEADER + yaml.safe_dump(crd_for(kind), sort_keys=False, width=120)


def crd_filename(kind: Kind) -> str:
    return f"{GROUP}_{kind.plural}.yaml"


def render_all() -> dict[str, str]:
    """File name -> YAML text for every kind, sorted by file name (so `cat crds/*.yaml` equals `loom crds`)."""
    return dict(sorted((crd_filename(kind), render_yaml(kind)) for kind in KINDS))


def write_all(*folders: Path) -> list[Path]:
    """Write every CRD into each folder (crds/ and the Helm chart's crds/ hold the same files)."""
    written = []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in render_all().items():
            path = folder / name
            path.write_text(text)
            written.append(path)
    return written
