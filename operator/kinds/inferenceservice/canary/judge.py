"""The canary analysis inside an InferenceService pass: what it reads (the edge) and what it means for the plan.

`read_analysis` (I/O) gathers what the pure decision (`analysis.decide`) needs: the analysis state as the last
status wrote it, the override annotation, whether the canary is ready at its step's share, and, when an
evaluation is due, each check's value for the canary and the stable version from Prometheus. `judge_canary`
(pure) turns that into the outcome and the model the plan should run; `persist_rollout` writes the verdict (and
posts its events) before the pass acts on it.

Ready at its share: the canary Deployment serves the model under analysis, was rendered for the step's weight
(annotation loom.dev/canary-weight) and both tracks are rolled out. A pause never counts while the share asked for
is not yet the share that runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ....autoscale.prometheus import PrometheusClient
from ....autoscale.promql import PodSelector
from ....autoscale.samples import PrometheusError
from ....core import client as kube
from ....core.events import post_events
from ....core.kit import status_patch
from ....core.model import API_VERSION, Manifest
from ....core.reconcile import Pass
from ..api import InferenceServiceSpec
from ..render import deployment_name
from ..rollout import model_of, rolled_out
from ..source.alias import registry_writes
from ..source.model import ModelRef
from .analysis import Outcome, Override, Reading, Rejections, decide, is_due, model_key
from .api import Analysis, AnalysisStatus, RejectedVersion, RolloutStatus
from .promql import Version, check_query

OVERRIDE_ANNOTATION = "loom.dev/canary"  # promote | abort | retry
WEIGHT_ANNOTATION = "loom.dev/canary-weight"
OverrideValue = Literal["promote", "abort", "retry"]


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


async def read_analysis(
    analysis: Analysis,
    body: Manifest,
    *,
    desired: ModelRef,
    stable_ref: ModelRef,
    stable: Manifest | None,
    canary: Manifest | None,
    runtime: str,
    prometheus_url: str | None,
    now: datetime,
) -> AnalysisInput:
    """The edge: status, annotations and (when due) Prometheus, for the canary of `desired`."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    previous = previous_rollout(body)
    key = model_key(desired.to_annotation())
    state = previous.analysis if previous.analysis is not None and previous.analysis.model_key == key else None
    ready = canary_ready(desired, state, stable, canary)
    seen = AnalysisInput(desired=desired, stable_ref=stable_ref, key=key, previous=previous,
                         override=override_of(body), ready=ready, now=now)  # fmt: skip
    if not ready or not is_due(analysis, state, now) or key in Rejections(tuple(previous.rejected)):
        return seen
    def side(ref: ModelRef, track: Literal["stable", "canary"]) -> Version:
        return Version(ref.display_version, PodSelector.for_owner(namespace, deployment_name(name, track)))

    sides = {"canary": side(desired, "canary"), "stable": side(stable_ref, "stable")}
    readings = await _read(analysis, sides, runtime, prometheus_url, now)
    return AnalysisInput(**{**seen.__dict__, "readings": readings})


async def _read(
    analysis: Analysis, sides: dict[str, Version], runtime: str, prometheus_url: str | None, now: datetime
) -> dict[str, Reading]:
    if prometheus_url is None:
        missing = "the operator has no Prometheus (settings prometheusUrl)"
        return {c.name: Reading(None, error=missing) for c in analysis.checks}
    readings: dict[str, Reading] = {}
    async with PrometheusClient(prometheus_url) as prometheus:
        for check in analysis.checks:
            values: dict[str, float | None] = {}
            try:
                for side in ("canary", "stable") if check.relative else ("canary",):
                    expr = check_query(check, sides[side], runtime=runtime, window_seconds=analysis.window_seconds)
                    samples = await prometheus.query(expr, at=now.timestamp())
                    finite = [s.value for s in samples if not math.isnan(s.value)]
                    values[side] = sum(finite) if finite else None
            except PrometheusError as exc:
                readings[check.name] = Reading(None, error=str(exc)[:300])
                continue
            readings[check.name] = Reading(values.get("canary"), values.get("stable"))
    return readings


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


async def persist_rollout(
    ctx: Pass[Any], judged: Judgement, seen: AnalysisInput, analysis: Analysis | None, followed_alias: str | None
) -> None:
    """status.rollout, the analysis' events and the consumed override: written before the pass acts; with the
    registry's part of the verdict (the rejection tag, the promotion alias, the followed alias restored) for a
    model from MLflow."""
    promoted = judged.outcome is not None and judged.outcome.action == "promote"
    judged.status = await registry_writes(
        judged.status, seen.desired, promote_alias=analysis.promote_alias if analysis else None, promoted=promoted,
        followed_alias=followed_alias, stable=seen.stable_ref,
    )  # fmt: skip
    before = (ctx.body.get("status") or {}).get("rollout") or {}
    patch = status_patch({"rollout": before}, {"rollout": judged.status.to_wire()})
    if patch is not None:
        await kube.patch_status(API_VERSION, "InferenceService", ctx.namespace, ctx.name, patch)
        ctx.body.setdefault("status", {})["rollout"] = judged.status.to_wire()
    if judged.outcome is not None:
        # With the state they announce: a pass that dies after this loses neither.
        post_events(ctx.body, judged.outcome.events)
    if judged.consumed_override:
        # Acted on: the annotation goes, so it never applies to a later canary by surprise.
        await kube.merge_patch(API_VERSION, "InferenceService", ctx.namespace, ctx.name,
                               {"metadata": {"annotations": {OVERRIDE_ANNOTATION: None}}})  # fmt: skip
