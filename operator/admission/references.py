"""References to other objects of the same namespace that do not exist: warned about, or rejected.

Which references: an InferenceGraph step's `serviceName` (an InferenceService), an InferenceService's
`model.fromTrainingJob.name` (a TrainingJob) and `features.featureView` (a FeatureView).

Why only warned by default. GitOps tools apply a folder in an order of their own: Helm and Argo CD put custom
kinds last in alphabetical order (InferenceGraph before InferenceService, InferenceService before TrainingJob),
`kubectl apply -f dir/` goes by file name, and Flux dry-runs the whole set before applying any of it. Rejecting a
reference to an object of the same commit would then fail the sync, and under Flux never converge. The
controllers already handle a missing target as a state, not an error: the graph reports ServiceNotFound, the
service TrainingJobNotFound, and both proceed when the target appears. So by default (`Warn`) the object is
admitted with an admission warning naming the field (kubectl prints it; Argo CD and Flux log it).

Where objects are applied by hand or in dependency order (Argo CD sync waves, CI that applies services before
graphs), a typo is better refused at once: `Reject` (chart value `webhook.missingReferences`) denies the write
with the same field path and message. Either way only a reference the write adds or changes is judged, so an
object whose target was deleted later can still be edited (and its finalizers removed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import Violation, step_path

MissingReferences = Literal["Warn", "Reject"]


@dataclass(frozen=True)
class Reference:
    """`field` of the admitted object names the object `kind`/`name` in the same namespace."""

    field: str
    kind: str
    name: str


def graph_references(spec: Mapping[str, Any]) -> list[Reference]:
    return [
        Reference(step_path(node, index, "serviceName"), "InferenceService", step["serviceName"])
        for node, body in (spec.get("nodes") or {}).items()
        for index, step in enumerate((body or {}).get("steps") or [])
        if step.get("serviceName")
    ]


def service_references(spec: Mapping[str, Any]) -> list[Reference]:
    found = []
    job = ((spec.get("model") or {}).get("fromTrainingJob") or {}).get("name")
    if job:
        found.append(Reference("spec.model.fromTrainingJob.name", "TrainingJob", job))
    view = (spec.get("features") or {}).get("featureView")
    if view:
        found.append(Reference("spec.features.featureView", "FeatureView", view))
    return found


def changed(references: list[Reference], before: list[Reference]) -> list[Reference]:
    """The references a write adds or changes (all of them on create)."""
    old = {(r.field, r.kind, r.name) for r in before}
    return [r for r in references if (r.field, r.kind, r.name) not in old]


def missing_violations(missing: list[Reference], namespace: str) -> list[Violation]:
    """One violation per reference to an object the handler found missing in the namespace."""
    return [Violation(r.field, f"{r.kind} {r.name!r} not found in namespace {namespace!r}") for r in missing]
