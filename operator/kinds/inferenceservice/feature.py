"""The one interface through which a feature of an InferenceService takes part in its reconcile pass.

The pass (controller.py) is the core: it reads the service's two tracks and its pods, plans the rollout
(rollout.py), renders and applies the tracks (render.py) and computes status (status.py). Everything else is a
feature, one package each (source/, enrichment/, llm/, canary/, queue/, traffic/), plugged in as one object whose
hooks the core calls in the order of `controller.FEATURES`; a hook a feature does not need is the no-op here.

A feature's hooks live in its package's `io.py` (its edge: the only module of the package that may do I/O); its
model and its pure decisions and rendering in the package's other modules. What a feature reads goes into its own
field of `Observed`, which the later hooks (its own and those of the features after it) read back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from loom.workloads.server.config import EnrichmentConfig

from ...core.kit import Event, Manifest
from ...core.pods import PodIndex
from ...core.reconcile import Pass
from ...defaults import Defaulted, EndpointDefaults
from ...settings import OperatorSettings
from .api import InferenceServiceSpec, InferenceServiceStatus
from .canary.judge import AnalysisInput, Judgement
from .llm.adapters import ResolvedAdapters
from .queue.admission import Admission, ServiceQueue
from .render import Track
from .rollout import RolloutPlan
from .source.api import AliasStatus
from .source.model import ModelRef, ResolveError

ServiceCtx = Pass[Defaulted[InferenceServiceSpec]]


@dataclass
class Observed:
    """What a pass read: its two tracks and its pods (the core's), then each feature's own reading."""

    stable: Manifest | None = None
    canary: Manifest | None = None
    pods: list[Manifest] = field(default_factory=list)
    desired: ModelRef | None = None  # source/: the model the spec asks for, resolved (None: it does not resolve now)
    resolve_error: ResolveError | None = None  # source/, enrichment/: why it does not
    alias: AliasStatus | None = None  # source/: the followed MLflow alias, as last asked
    features: EnrichmentConfig | None = None  # enrichment/: spec.features resolved against its FeatureView
    features_error: ResolveError | None = None
    adapters: ResolvedAdapters | None = None  # llm/: spec.adapters resolved (None: the service has none)
    adapter_reports: dict[str, dict[str, Any] | str] = field(default_factory=dict)  # llm/: ready pod -> report
    analysis: AnalysisInput | None = None  # canary/: what the canary analysis read, while a canary is judged
    queue: ServiceQueue | None = None  # queue/: labelled kueue.x-k8s.io/queue-name: its Workloads
    activator_pods: list[Manifest] = field(default_factory=list)  # traffic/: the scale-to-zero activator's
    # traffic/: the InferencePool found under the service's name this pass (None: none asked, or not applied)
    inference_pool: Literal["absent", "ours", "theirs", "no_crd"] | None = None
    plan: RolloutPlan = field(default_factory=lambda: RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting"))


@dataclass
class Draft:
    """The plan as the features shape it before the core turns it into tracks (rollout.plan_rollout)."""

    total: int  # replicas asked for (the autoscaler's, within bounds); Kueue's admission caps it
    run: ModelRef | None  # the model the tracks run (None: keep what runs, e.g. while the spec is invalid)
    blocked: bool  # invalid, or its FeatureView missing: touch nothing, report what still runs
    percent: int | Literal["spec"] | None = "spec"  # the canary's share ("spec": canaryPercent)
    reject_canary: bool = False  # the canary's model was rejected: it leaves at once
    judgement: Judgement | None = None  # canary/: the analysis' decision this pass
    admission: Admission | None = None  # queue/: the replicas Kueue admitted


@dataclass(frozen=True)
class Plan:
    rollout: RolloutPlan
    invalid: str | None  # the pass's own, or the server contract's refusal of what the CRD allows
    judgement: Judgement | None = None
    admission: Admission | None = None
    applies: bool = False  # the tracks are rendered and applied this pass (a model resolved, nothing blocks)


@dataclass(frozen=True)
class ServicePass:
    """What every hook gets beside the pass: the operator's settings, its clock, a way to ask for a later pass."""

    ctx: ServiceCtx
    settings: OperatorSettings
    defaults: EndpointDefaults
    now: datetime
    later: Callable[[float], None]  # another pass in that many seconds (a no-op where nothing schedules)
    pods: PodIndex | None = None  # the serving and activator pods (Kopf's watch cache; None: not bound)

    @property
    def spec(self) -> InferenceServiceSpec:
        assert self.ctx.spec is not None  # hooks run only for a parsed spec
        return self.ctx.spec.spec


class Feature:
    """A feature's hooks, in the order the pass calls them; each is a no-op unless the feature overrides it."""

    def check(self, body: Manifest, spec: InferenceServiceSpec) -> str | None:
        """What the schema cannot refuse (InvalidSpec's message), or None."""
        return None

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        """Read what the feature needs into its fields of `seen` (after the core read the tracks and pods)."""

    def decide(self, p: ServicePass, seen: Observed, draft: Draft) -> None:
        """Pure: shape the draft plan (replicas admitted, the canary's model and share)."""

    def render(self, p: ServicePass, seen: Observed, plan: Plan, track: Track, deployment: Manifest) -> None:
        """Pure: adjust a track's rendered Deployment before it is applied."""

    async def before_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        """Writes that must precede the tracks' (a verdict persisted before it acts, the routing before replicas)."""

    async def after_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        """Writes that follow the tracks', and asking for a later pass."""

    def status(
        self, p: ServicePass, seen: Observed, plan: Plan, status: InferenceServiceStatus,
        previous: InferenceServiceStatus | None,
    ) -> list[Event]:
        """Pure: fill the feature's part of status; the events it deserves."""
        return []

    def register(self, trigger: Callable[[str, str], Awaitable[None]]) -> None:
        """Kopf handlers the feature needs (other kinds' events that re-run a service: `trigger(namespace, name)`)."""
