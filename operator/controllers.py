"""Registers every kind's controller and the builtin autoscaler with Kopf.

Each kind lives in its own package, `kinds/<kind>/`: its API model (`api.py`), its pure children and status, its
controller (`controller.py`, `register(settings)`) and its scaling adapter. The reconcile runner, the render kit,
the Kubernetes client, leadership and events are shared, in `core/`. Settings come from
`settings.OperatorSettings`, never from os.environ here.
"""

from __future__ import annotations

import importlib

from .api import KINDS
from .autoscale import loop as autoscaler
from .autoscale.adapters import KindAdapter
from .core.runner import watch_objects
from .kinds.featureview.autoscaling.io import ADAPTER as FEATURE_VIEW
from .kinds.inferencegraph.autoscaling.io import ADAPTER as INFERENCE_GRAPH
from .kinds.inferenceservice.autoscaling.io import ADAPTER as INFERENCE_SERVICE
from .settings import OperatorSettings

# Each kind's package; its controller module exposes register(settings).
_CONTROLLERS: dict[str, str] = {
    "FeatureView": "featureview",
    "InferenceService": "inferenceservice",
    "InferenceGraph": "inferencegraph",
    "TrainingJob": "trainingjob",
}

# The kinds the builtin autoscaler scales, each through its adapter.
ADAPTERS: tuple[KindAdapter, ...] = (INFERENCE_SERVICE, INFERENCE_GRAPH, FEATURE_VIEW)


def register(settings: OperatorSettings) -> None:
    # The watch cache, before any controller reads an object or applies a child (core/watch_cache.py).
    watch_objects()
    for kind in KINDS:
        importlib.import_module(f"{__package__}.kinds.{_CONTROLLERS[kind.kind]}.controller").register(settings)
    # The builtin autoscaler of InferenceServices, InferenceGraph routers and FeatureView servers (one loop per kind).
    autoscaler.register(settings, ADAPTERS)
