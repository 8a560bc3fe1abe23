"""What the builtin autoscaler (loop.py) needs to know about each kind it scales: a small adapter per kind.

The loop, the Prometheus query, the pure decision, the status and the events are the same for every kind; an
adapter only says, for one object read from the API server,
- whether it is autoscaled now and by which `Autoscaling` (None: not this object's business this round),
- how many replicas it asks for now and which pods are its replicas (a label selector),
- where a new replica count is written, with which resourceVersion as a precondition.

- InferenceService: spec.autoscaling; replicas go to its own scale subresource (spec.replicas), from which the
  reconcile pass renders the stable and canary Deployments.
- InferenceGraph: spec.router.autoscaling; replicas go to its own scale subresource (spec.router.replicas), from
  which the reconcile pass renders the router Deployment (a write to the Deployment itself would be undone by the
  next server-side apply, and the scale subresource gives the write a resourceVersion precondition and a reconcile
  trigger, exactly as for an InferenceService).
- FeatureView: spec.server.autoscaling of the project's oldest view (of those in its config) that sets one; one
  Deployment serves every view of a project, so no view owns its replicas: they go to the feature server
  Deployment's scale subresource, and the reconcile pass keeps the Deployment's replicas while it is autoscaled.

Each kind's adapter lives beside its kind (kinds/<kind>/adapter.py); controllers.py hands them to the loop.

Status (status.autoscaling, MetricsAvailable) and events go on the object itself; for a FeatureView on the view whose
autoscaling is in force.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..core.kit import Manifest
from ..core.model import API_VERSION
from .spec import Autoscaling

if TYPE_CHECKING:
    from ..settings import OperatorSettings

# The field manager of every write the autoscaler makes (replicas through a scale subresource, its status).
FIELD_MANAGER = "loom-autoscaler"


@dataclass(frozen=True)
class Target:
    """One autoscaled object as this round sees it."""

    autoscaling: Autoscaling
    current_replicas: int  # asked for now (ready + starting)
    selector: str  # label selector of its replicas' pods
    # Where a new count goes: the scale subresource of (apiVersion, kind, name), with this resourceVersion.
    scale_api_version: str
    scale_kind: str
    scale_name: str
    scale_resource_version: str


def clamp(replicas: int, autoscaling: Autoscaling) -> int:
    return max(autoscaling.min_replicas, min(autoscaling.max_replicas, replicas))


class Engines(Protocol):
    """Engines keda and hpa for a kind that offers them: the object each needs, and the replicas to start from."""

    def engine_object(
        self, owner: Manifest, autoscaling: Autoscaling, settings: OperatorSettings
    ) -> tuple[Manifest | None, list[tuple[str, str]]]:
        """What the engine needs (None for builtin), and the (apiVersion, kind) of the engine objects it must not
        leave behind. Raises EngineError (or ValueError) for what the engine cannot do."""

    def starting_replicas(self, body: Manifest) -> int:
        """Replicas to write once when an engine takes over an object whose spec.replicas is unset."""


class KindAdapter(Protocol):
    kind: str
    plural: str
    engines: Engines | None  # engines keda and hpa, where the kind offers them (else builtin only)

    def autoscaling(self, spec: Manifest) -> object | None:
        """The raw autoscaling block of a raw spec (the index must not fail on a spec that does not validate)."""

    async def target(self, body: Manifest) -> Target | None:
        """The object's autoscaling target now, or None when it is not autoscaled (or another object speaks for
        its replicas)."""


def raw_block(spec: Manifest, *path: str) -> object | None:
    """The dict at `path` in a raw spec, or None."""
    node: object = spec
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def scale_self(body: Manifest, autoscaling: Autoscaling, current: int, selector: str) -> Target:
    """The target of a kind whose own scale subresource takes the replicas."""
    meta = body["metadata"]
    return Target(
        autoscaling, current, selector, API_VERSION, str(body.get("kind")), meta["name"], meta["resourceVersion"]
    )
