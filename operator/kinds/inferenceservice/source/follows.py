"""What an InferenceService follows: the objects whose changes re-run it, as keys of a Kopf index.

A TrainingJob that its model or one of its adapters comes from (`fromTrainingJob`: a newer checkpoint rolls out,
a new adapter loads in place), and the FeatureView it enriches requests from (`features.featureView`: Ready or
moved). The controller's event handlers for those kinds look the followers up in the index instead of listing
every InferenceService of the namespace on each event (a LIST per TrainingJob phase change: 500 of them when 200
jobs start at once, bench/bench_kubeflow_p1.py). Pure: reads the spec as stored, tolerating any shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Followed = Literal["TrainingJob", "FeatureView"]


def followed(spec: Mapping[str, Any] | None) -> set[tuple[Followed, str]]:
    """(kind, name) of every object the spec follows, in the service's own namespace."""
    spec = spec if isinstance(spec, Mapping) else {}
    found: set[tuple[Followed, str]] = set()
    model = spec.get("model")
    adapters = spec.get("adapters")
    sources = [model, *(adapters if isinstance(adapters, list) else [])]
    for source in sources:
        job = source.get("fromTrainingJob") if isinstance(source, Mapping) else None
        name = job.get("name") if isinstance(job, Mapping) else None
        if isinstance(name, str) and name:
            found.add(("TrainingJob", name))
    features = spec.get("features")
    view = features.get("featureView") if isinstance(features, Mapping) else None
    if isinstance(view, str) and view:
        found.add(("FeatureView", view))
    return found


def index_entries(namespace: str, name: str, spec: Mapping[str, Any] | None) -> dict[tuple[str, str, str], str]:
    """The service's entries in the followers index: (kind, namespace, followed name) -> the service's name."""
    return {(kind, namespace, followed_name): name for kind, followed_name in followed(spec)}


def followers(index: Mapping[tuple[str, str, str], Any] | None, kind: Followed, namespace: str, name: str) -> list[str]:
    """The names of the services that follow `kind` `namespace`/`name`, sorted (each once)."""
    if index is None:
        return []
    return sorted(set(index.get((kind, namespace, name)) or ()))
