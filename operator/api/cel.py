"""The CRDs' CEL rules (`x-kubernetes-validations`) evaluated in Python: the one evaluator for objects that never
went through the API server's admission (the SDK's validate, tests, renders), so a rule is written once, as CEL on
its model (core/model.py `cel`), and no pydantic validator repeats it.

The operator itself does not evaluate them: every object it reconciles was stored by the API server, which checked
these rules at admission (core/reconcile.py `parse`).

Transition rules (those that read oldSelf, e.g. "engine is immutable") need the stored object and are left to the
API server; so are references to other objects (the admission webhook's part).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import cache
from typing import Any, TypeVar

import cel
from cel.stdlib import sum_
from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from ..core.kind import Kind
from ..core.model import ApiModel, Manifest
from .crd import crd_for, model_schema

Schema = dict[str, Any]
M = TypeVar("M", bound=ApiModel)


def _is_sorted(items: list[Any]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(items))


# Kubernetes' CEL list library functions the rules use that the binding's Rust core lacks (tests/unit/test_cel.py
# checks that every function a CRD rule calls is the core's or one of these, so none is skipped unnoticed).
KUBERNETES_FUNCTIONS: dict[str, Any] = {"isSorted": _is_sorted, "sum": sum_}


@cache
def program(rule: str) -> Any:
    """The compiled rule (each compiled once per process)."""
    return cel.compile(rule)


@cache
def _kind_schema(kind: Kind) -> Schema:
    schema: Schema = crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@cache
def _model_schema(model: type[ApiModel]) -> Schema:
    return model_schema(model)


Where = tuple[tuple[str | int, ...], str]  # a field as pydantic locates it, and as the API server writes it


def _rules_at(schema: Schema, value: Any, where: Where) -> Iterator[tuple[Where, Any, dict[str, str]]]:
    """(where, value, rule) for every CEL rule whose node holds a value in `value`, depth first."""
    loc, path = where
    for rule in schema.get("x-kubernetes-validations") or []:
        yield where, value, rule
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from _rules_at(sub, value[name], ((*loc, name), f"{path}.{name}" if path else name))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                yield from _rules_at(extra, item, ((*loc, key), f"{path}[{key}]"))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _rules_at(schema["items"], item, ((*loc, index), f"{path}[{index}]"))


def _evaluate(expression: str, node: Any) -> Any:
    return program(expression).execute({"self": node, **KUBERNETES_FUNCTIONS})


def _message(rule: dict[str, str], node: Any) -> str:
    """The rule's messageExpression's string, else its message: as the API server, which falls back to the message
    when the expression errs or gives a blank or multi-line string."""
    if "messageExpression" in rule:
        try:
            text = _evaluate(rule["messageExpression"], node)
        except Exception:
            text = None
        if isinstance(text, str) and text.strip() and "\n" not in text:
            return text
    return rule["message"]


def _broken(schema: Schema, value: Any, where: Where = ((), "")) -> Iterator[tuple[Where, Any, str]]:
    """(where, value, message) for every rule `value` breaks, `where` ending with the rule's fieldPath. A rule that
    cannot be evaluated counts as broken, as the API server refuses an object one of its rules errs on."""
    for (loc, path), node, rule in _rules_at(schema, value, where):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: needs the stored object
        field_path = rule.get("fieldPath", "")
        at = (*loc, *(part for part in field_path.split(".") if part)), path + field_path
        try:
            ok = _evaluate(rule["rule"], node)
        except Exception as error:
            yield at, node, f"{rule['message']} (the rule could not be evaluated: {error})"
            continue
        if ok is not True:
            yield at, node, _message(rule, node)


def cel_problems(kind: Kind, manifest: Manifest) -> list[str]:
    """The messages of the kind's CRD CEL rules `manifest` breaks, each after its field path as the API server
    writes it (`spec.rollout.analysis: set canaryPercent or analysis, not both`). `manifest` is the object as the
    API server validates it: defaults applied (a model's `to_wire()`); its status is not checked."""
    schema = _kind_schema(kind)
    problems = []
    if (manifest.get("metadata") or {}).get("name"):
        # Only a root rule may read metadata.name (the kind's name rule). The API server always has a name there
        # (generateName is applied before it validates); a manifest without one is the caller's to report.
        root = {"x-kubernetes-validations": schema.get("x-kubernetes-validations") or []}
        problems += [f"metadata.name: {message}" for _, _, message in _broken(root, manifest)]
    if "spec" in manifest:
        spec = schema["properties"]["spec"]
        problems += [f"{path}: {message}" for (_, path), _, message in _broken(spec, manifest["spec"], ((), "spec"))]
    return problems


def admitted(model: type[M], data: Any) -> M:
    """`model.model_validate(data)` and then the CEL rules its schema carries, as the API server adds them at
    admission: a pydantic ValidationError either way (a rule's error at its field, with the rule's message)."""
    built = model.model_validate(data)
    broken = list(_broken(_model_schema(model), built.to_wire()))
    if broken:
        raise ValidationError.from_exception_data(model.__name__, [
            InitErrorDetails(type=PydanticCustomError("cel", message), loc=loc, input=node)
            for (loc, _), node, message in broken
        ])
    return built
