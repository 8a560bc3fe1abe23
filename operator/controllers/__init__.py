"""Thin Kopf handlers: read, render (pure), apply (kube layer), compute status (pure).

`register` wires every kind's controller. A kind without its controller yet gets the placeholder, which says so
honestly in its Ready condition instead of pretending.

A controller is `<kind>.py` with `register(settings)`: its Kopf handlers trigger one idempotent
`reconcile(namespace, name)` through the shared `runner.Runner` (serialised, coalesced, bounded, resynced without
a finalizer; its docstring shows a new controller's skeleton), render with `render/<kind>.py` on the render kit
(`render/kit.py`), write through `kube`, and post the state machine's events with `events.post_events`.
Settings come from `settings.OperatorSettings`, never from os.environ here.
"""

from __future__ import annotations

from ..api import KINDS
from ..settings import OperatorSettings
from . import placeholder

# Kinds whose real controllers exist; each module exposes register(settings).
_CONTROLLERS: dict[str, str] = {
    "FeatureView": "featureview",
    "InferenceService": "inferenceservice",
    "InferenceGraph": "inferencegraph",
    "TrainingJob": "trainingjob",
}


def register(settings: OperatorSettings) -> None:
    import importlib

    for kind in KINDS:
        module_name = _CONTROLLERS.get(kind.kind)
        if module_name is None:
            placeholder.register(kind)
        else:
            importlib.import_module(f"{__name__}.{module_name}").register(settings)
    # The builtin autoscaler of InferenceServices, InferenceGraph routers and FeatureView servers (one loop per kind).
    from . import autoscaler

    autoscaler.register(settings)
