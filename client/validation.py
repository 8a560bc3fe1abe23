"""Check an object before it reaches the cluster, with the rules the API server would apply.

Three layers, each from the API's own source: the pydantic models (types, enums, ranges, patterns, the models'
own validators), the kind's name rule, and the CRD's CEL rules (`x-kubernetes-validations`, generated from the
same models) evaluated by the operator's API package (loom.operator.api.cel: one evaluator for every object that
has not been through admission). Transition rules (those that read oldSelf, e.g. "engine is immutable") need the
stored object and are left to the API server, and so are references to other objects (the admission webhook's
part).
"""

from __future__ import annotations

from pydantic import ValidationError

from loom.operator.api.cel import cel_problems

from .models import InvalidObject, LoomObject, kind_of, name_of, pydantic_problems


def problems(obj: LoomObject) -> list[str]:
    """Everything the API server would refuse about this object (empty when it would be admitted)."""
    found = []
    name = name_of(obj)
    if not name:
        found.append("metadata.name: required")
    found += cel_problems(kind_of(obj), obj.to_wire())
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
