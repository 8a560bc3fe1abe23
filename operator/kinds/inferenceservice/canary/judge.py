"""The canary analysis' part of an InferenceService's plan (pure): `judge_canary` turns what the pass read
(`AnalysisInput`, read by io.py) into the outcome, the model the plan runs and the canary's share; `held_percent`
is the share while nothing can be judged.

Ready at its share: the canary Deployment serves the model under analysis, was rendered for the step's weight
(annotation loom.dev/canary-weight) and both tracks are rolled out. A pause never counts while the share asked for
is not yet the share that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from ....core.model import Manifest
from ..api import InferenceServiceSpec
from ..rollout import model_of, rolled_out
from ..source.model import ModelRef
from .analysis import Outcome, Override, Reading, Rejections, decide
from .api import Analysis, AnalysisStatus, RejectedVersion, RolloutStatus

OVERRIDE_ANNOTATION = "loom.dev/canary"  # promote | abort | retry
WEIGHT_ANNOTATION = "loom.dev/canary-weight"
# What the annotation may say: the analysis' overrides, and retry (try a rejected version again).
OverrideValue = Override | Literal["retry"]


def override_of(body: Manifest) -> OverrideValue | None:
    value = ((body.get("metadata") or {}).get("annotations") or {}).get(OVERRIDE_ANNOTATION)
    return value if value in ("promote", "abort", "retry") else None


def previous_rollout(body: Manifest) -> RolloutStatus:
    """status.rollout as the last pass wrote it (a fresh one when absent or unreadable)."""
    raw = (body.get("status") or {}).get("rollout")
    try:
        return RolloutStatus.model_validate(raw or {})
    except ValueError:
        return RolloutStatus()


def applied_weight(canary: Manifest | None) -> int | None:
    annotations = ((canary or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return int(annotations[WEIGHT_ANNOTATION])
    except (KeyError, TypeError, ValueError):
        return None


def canary_ready(desired: ModelRef, state: AnalysisStatus | None, stable: Manifest | None,
                 canary: Manifest | None) -> bool:
    if canary is None or state is None or model_of(canary) != desired:
        return False
    return applied_weight(canary) == state.weight and rolled_out(canary) and rolled_out(stable)


@dataclass(frozen=True)
class AnalysisInput:
    """What the pass read for the analysis of the canary `desired` (the decision is `judge_canary`)."""

    desired: ModelRef
    stable_ref: ModelRef
    key: str
    previous: RolloutStatus
    override: OverrideValue | None
    ready: bool
    now: datetime
    readings: dict[str, Reading] | None = None


@dataclass
class Judgement:
    """The outcome, the model the plan runs, the canary's share and the rollout status to write."""

    run: ModelRef  # the spec's model, or the stable one when that model was rejected
    percent: int | None  # the canary's share for the plan (None: one track, i.e. promote or roll back)
    status: RolloutStatus
    outcome: Outcome | None = None
    rejected_now: RejectedVersion | None = None
    consumed_override: bool = False
    retried: bool = False
    rejecting: bool = False  # the canary's model is rejected: it leaves at once (rollout.plan_rollout)


def judge_canary(analysis: Analysis, seen: AnalysisInput) -> Judgement:
    """Pure: the analysis' next step for the canary `seen.desired` against the stable version."""
    previous = seen.previous
    rejections = Rejections(tuple(previous.rejected))
    retried = False
    if seen.override == "retry" and seen.key in rejections:
        rejections = Rejections(rejections.without(seen.key))
        retried = True
    if seen.key in rejections:
        # Rolled back before: never tried again (until loom.dev/canary: retry); the stable version keeps serving.
        status = previous.model_copy(update={"rejected": list(rejections.entries)})
        return Judgement(run=seen.stable_ref, percent=None, status=status, consumed_override=seen.override is not None,
                         rejecting=True)  # fmt: skip
    state = previous.analysis
    if retried and state is not None and state.model_key == seen.key:
        state = None  # a fresh analysis for a version asked to be retried
    override: Override | None = None
    if seen.override == "promote" or seen.override == "abort":
        override = seen.override
    outcome = decide(
        analysis, state, version=seen.desired.display_version, key=seen.key, now=seen.now, canary_ready=seen.ready,
        readings=seen.readings, override=override,
    )  # fmt: skip
    rejected = tuple(rejections.entries)
    run, percent = seen.desired, min(outcome.weight, 99)
    percent_or_none: int | None = percent  # a 100% step keeps one stable replica to compare with
    if outcome.action == "rollback":
        if outcome.rejected is not None:
            rejected = rejections.with_(outcome.rejected)
        run, percent_or_none = seen.stable_ref, None
    elif outcome.action == "promote":
        percent_or_none = None
    status = RolloutStatus(
        traffic_split=previous.traffic_split, analysis=outcome.state, rejected=list(rejected),
        promoted_alias=previous.promoted_alias,
    )
    return Judgement(
        run=run, percent=percent_or_none, status=status, outcome=outcome, rejected_now=outcome.rejected,
        consumed_override=seen.override is not None, retried=retried, rejecting=outcome.action == "rollback",
    )  # fmt: skip


def held_percent(spec: InferenceServiceSpec, body: Manifest, canary: Manifest | None) -> int | Literal["spec"] | None:
    """The canary's share when the analysis cannot judge this pass (the model does not resolve now): the share its
    step runs, never a promotion by default."""
    if spec.rollout.analysis is None or canary is None:
        return "spec"
    state = previous_rollout(body).analysis
    if state is not None and state.verdict == "Promoted":
        return None
    if state is not None and state.verdict == "RolledBack":
        return 0  # the canary left is the rejected one: no traffic, the stable track serves
    return min(state.weight if state is not None else spec.rollout.analysis.steps[0].weight, 99)
