"""Build Loom objects from the API's own pydantic models (the ones the CRDs are generated from).

Every model comes from `loom.operator.api`, so a field the CRD has, the SDK has, with its type, default and
description (IDE completion and mypy see them). The builders only add what Kubernetes needs around a spec: the
object's name, namespace and labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from loom.operator.api import (
    API_VERSION,
    KINDS,
    FeatureView,
    FeatureViewSpec,
    InferenceGraph,
    InferenceGraphSpec,
    InferenceService,
    InferenceServiceSpec,
    Kind,
    TrainingJob,
    TrainingJobSpec,
)

# One of the four kinds, as a typed model.
LoomObject = TrainingJob | InferenceService | InferenceGraph | FeatureView
AnyObject = TypeVar("AnyObject", TrainingJob, InferenceService, InferenceGraph, FeatureView)

_BY_KIND: dict[str, Kind] = {kind.kind: kind for kind in KINDS}
_BY_MODEL: dict[type[Any], Kind] = {kind.model: kind for kind in KINDS}
# What `loom get <resource>` accepts, as kubectl does: kind, plural, singular and short names, any case.
_BY_NAME: dict[str, Kind] = {
    alias.lower(): kind
    for kind in KINDS
    for alias in (kind.kind, kind.plural, kind.singular, *kind.short_names)
}


class InvalidObject(ValueError):
    """The object would be refused by the API server (or could never work): every problem, with its field path."""

    def __init__(self, kind: str, name: str, problems: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.problems = problems
        shown = name or "<unnamed>"
        super().__init__(f"{kind} {shown} is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


def kind_of(obj_or_model: LoomObject | type[LoomObject]) -> Kind:
    model = obj_or_model if isinstance(obj_or_model, type) else type(obj_or_model)
    return _BY_MODEL[model]


def kind_named(name: str) -> Kind:
    """The kind for a kubectl-style resource name (trainingjob, trainingjobs, ltj, TrainingJob, ...)."""
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        known = ", ".join(sorted({k.plural for k in KINDS} | {s for k in KINDS for s in k.short_names}))
        raise ValueError(f"unknown Loom resource {name!r} (known: {known})") from None


def _metadata(
    name: str, namespace: str | None, labels: Mapping[str, str] | None, annotations: Mapping[str, str] | None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    if labels:
        metadata["labels"] = dict(labels)
    if annotations:
        metadata["annotations"] = dict(annotations)
    return metadata


def training_job(
    name: str,
    spec: TrainingJobSpec,
    *,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> TrainingJob:
    """A TrainingJob named `name` (namespace: the client's, when left out)."""
    return TrainingJob(metadata=_metadata(name, namespace, labels, annotations), spec=spec)


def inference_service(
    name: str,
    spec: InferenceServiceSpec,
    *,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> InferenceService:
    """An InferenceService named `name`."""
    return InferenceService(metadata=_metadata(name, namespace, labels, annotations), spec=spec)


def inference_graph(
    name: str,
    spec: InferenceGraphSpec,
    *,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> InferenceGraph:
    """An InferenceGraph named `name`."""
    return InferenceGraph(metadata=_metadata(name, namespace, labels, annotations), spec=spec)


def feature_view(
    name: str,
    spec: FeatureViewSpec,
    *,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> FeatureView:
    """A FeatureView named `name`."""
    return FeatureView(metadata=_metadata(name, namespace, labels, annotations), spec=spec)


def name_of(obj: LoomObject) -> str:
    return str(obj.metadata.get("name") or "")


def namespace_of(obj: LoomObject) -> str | None:
    namespace = obj.metadata.get("namespace")
    return str(namespace) if namespace else None


def pydantic_problems(error: ValidationError) -> list[str]:
    """`spec.workers.replicas: Input should be greater than or equal to 1`, one per error, with wire names."""
    return [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()]


def from_manifest(manifest: Mapping[str, Any]) -> LoomObject:
    """A typed object from a manifest (a dict as kubectl or the API server writes it); InvalidObject if it does not
    fit its kind's model."""
    if manifest.get("apiVersion") != API_VERSION:
        raise ValueError(f"not a Loom object: apiVersion {manifest.get('apiVersion')!r} (want {API_VERSION})")
    kind = _BY_KIND.get(str(manifest.get("kind")))
    if kind is None:
        raise ValueError(f"not a Loom kind: {manifest.get('kind')!r} (known: {', '.join(_BY_KIND)})")
    try:
        obj: LoomObject = kind.model.model_validate(dict(manifest))  # type: ignore[assignment]
    except ValidationError as error:
        name = str((manifest.get("metadata") or {}).get("name") or "")
        raise InvalidObject(kind.kind, name, pydantic_problems(error)) from None
    return obj


def parse(text: str) -> list[LoomObject]:
    """Every Loom object in YAML text; objects of other kinds (a Secret) are refused, so a file meant for kubectl
    says so instead of being half-applied."""
    return [from_manifest(doc) for doc in _documents(yaml.safe_load_all(text))]


def load(path: str | Path) -> list[LoomObject]:
    """Every Loom object in a YAML file (see parse)."""
    return parse(Path(path).read_text())


def _documents(docs: Iterable[Any]) -> Iterable[Mapping[str, Any]]:
    for doc in docs:
        if doc is None:
            continue
        if not isinstance(doc, Mapping):
            raise ValueError(f"a YAML document is not an object: {doc!r:.80}")
        yield doc


def to_manifest(obj: LoomObject) -> dict[str, Any]:
    """The object as Kubernetes stores it (camelCase, unset optional fields left out)."""
    return obj.to_wire()
