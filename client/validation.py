"""Check an object before it reaches the cluster, with the rules the API server would apply.

Three layers, each from the API's own source: the pydantic models (types, enums, ranges, patterns, the models'
own validators), the kind's name rule, and the CRD's CEL rules (`x-kubernetes-validations`, generated from the
same models) evaluated here with the CEL library the operator uses. Transition rules (those that read oldSelf,
e.g. "engine is immutable") need the stored object and are left to the API server, and so are references to
other objects (the admission webhook's part).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import cel
from pydantic import ValidationError

from loom.operator.api import crd_for

from .models import InvalidObject, LoomObject, kind_of, name_of, pydantic_problems

Schema = dict[str, Any]


@cache
def _program(rule: str) -> Any:
    return cel.compile(rule)


def _rules_at(schema: Schema, value: Any, path: str) -> Iterator[tuple[str, Schema, Any]]:
    """(path, rule, value) for every CEL rule whose node holds a value in `value`, depth first."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, value
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from _rules_at(sub, value[name], f"{path}.{name}" if path else name)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                yield from _rules_at(extra, item, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _rules_at(schema["items"], item, f"{path}[{index}]")


def cel_problems(obj: LoomObject) -> list[str]:
    """The messages of the CRD's CEL rules this object breaks, each with its field path."""
    kind = kind_of(obj)
    schema = crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    manifest = obj.to_wire()
    manifest.pop("status", None)
    problems = []
    for path, rule, value in _rules_at(schema, manifest, ""):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: needs the stored object
        try:
            ok = _program(rule["rule"]).execute({"self": value})
        except Exception:
            continue
        if ok is False:
            where = path + rule.get("fieldPath", "")
            problems.append(f"{where or 'metadata.name'}: {rule['message']}")
    return problems


def problems(obj: LoomObject) -> list[str]:
    """Everything the API server would refuse about this object (empty when it would be admitted)."""
    found = []
    name = name_of(obj)
    if not name:
        found.append("metadata.name: required")
    found += cel_problems(obj)
    # The name rule is also a root CEL rule; reported once, with its own message.
    return list(dict.fromkeys(found))


def validate(obj: LoomObject) -> LoomObject:
    """The object again when the API server would admit it; InvalidObject listing every problem otherwise.

    Pydantic already checked types, enums, ranges and patterns when the object was built (or validate_assignment
    when a field was set); this re-validates the whole object (a model changed in place through a nested dict
    is caught) and adds the CRD's CEL rules."""
    kind = kind_of(obj)
    try:
        rebuilt = type(obj).model_validate(obj.to_wire())
    except ValidationError as error:
        raise InvalidObject(kind.kind, name_of(obj), pydantic_problems(error)) from None
    found = problems(rebuilt)
    if found:
        raise InvalidObject(kind.kind, name_of(obj), found)
    return obj
