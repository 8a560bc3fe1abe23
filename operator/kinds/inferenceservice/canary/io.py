"""The canary analysis' edge and hooks: what it reads for the pure decision (judge.py), and the verdict it writes.

`read_analysis` gathers what `judge_canary` needs: the analysis state as the last status wrote it, the override
annotation, whether the canary is ready at its step's share, and, when an evaluation is due, each check's value
for the canary and the stable version from Prometheus. `persist_rollout` writes the verdict (and posts its events)
before the pass acts on it. `CanaryAnalysis` plugs both into the pass (feature.py).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from ....autoscale.prometheus import PrometheusClient
from ....autoscale.promql import PodSelector
from ....autoscale.samples import PrometheusError
from ....core import client as kube
from ....core.events import post_events
from ....core.kit import Event, Manifest, status_patch
from ....core.model import API_VERSION
from ....core.reconcile import Pass
from ..api import InferenceServiceStatus
from ..feature import Draft, Feature, Observed, Plan, ServicePass
from ..render import Track, deployment_name
from ..rollout import model_of
from ..source.alias import followed
from ..source.io import registry_writes
from ..source.model import ModelRef
from .analysis import Reading, Rejections, is_due, model_key, seconds_until_due
from .api import Analysis
from .judge import (
    OVERRIDE_ANNOTATION,
    WEIGHT_ANNOTATION,
    AnalysisInput,
    Judgement,
    canary_ready,
    held_percent,
    judge_canary,
    override_of,
    previous_rollout,
)
from .promql import Version, check_query
from .report import analysis_condition


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


class CanaryFeature(Feature):
    """spec.rollout.analysis: a new model version walks the steps, judged on Prometheus, promoted or rolled back."""

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        analysis, stable_ref = p.spec.rollout.analysis, model_of(seen.stable)
        if not p.ctx.valid or analysis is None or seen.desired is None or stable_ref is None \
                or seen.desired == stable_ref:
            return
        seen.analysis = await read_analysis(
            analysis, p.ctx.body, desired=seen.desired, stable_ref=stable_ref, stable=seen.stable,
            canary=seen.canary, runtime=p.spec.runtime, prometheus_url=p.settings.prometheus_url, now=p.now,
        )  # fmt: skip

    def decide(self, p: ServicePass, seen: Observed, draft: Draft) -> None:
        draft.percent = held_percent(p.spec, p.ctx.body, seen.canary)
        analysis = p.spec.rollout.analysis
        if draft.blocked or analysis is None or seen.analysis is None:
            return
        judged = judge_canary(analysis, seen.analysis)
        draft.run, draft.percent, draft.reject_canary, draft.judgement = (
            judged.run, judged.percent, judged.rejecting, judged
        )

    def render(self, p: ServicePass, seen: Observed, plan: Plan, track: Track, deployment: Manifest) -> None:
        outcome = plan.judgement.outcome if plan.judgement is not None else None
        if track == "canary" and outcome is not None:
            # The analysis' step this canary runs: its pause counts once this rolled out.
            deployment["metadata"].setdefault("annotations", {})[WEIGHT_ANNOTATION] = str(outcome.state.weight)

    async def before_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        if plan.judgement is None:
            return
        # The verdict is written before anything acts on it: killed in between, the next pass reads it back
        # (a rolled-back version stays rejected, a step once started keeps its start).
        assert seen.analysis is not None
        target = followed(p.spec.model)
        await persist_rollout(p.ctx, plan.judgement, seen.analysis, p.spec.rollout.analysis,
                              target[1] if target else None)  # fmt: skip

    async def after_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        analysis = p.spec.rollout.analysis
        state = plan.judgement.status.analysis if plan.judgement is not None else None
        if analysis is not None and (wait := seconds_until_due(analysis, state, p.now)):
            p.later(wait)

    def status(
        self, p: ServicePass, seen: Observed, plan: Plan, status: InferenceServiceStatus,
        previous: InferenceServiceStatus | None,
    ) -> list[Event]:
        judged = plan.judgement
        status.rollout = judged.status if judged is not None else (previous.rollout if previous else None)
        if status.rollout is not None:
            # Announced by the analysis' own events (one per step, check failure, hold, verdict), not twice.
            status.conditions = analysis_condition(status.conditions, status.rollout, p.ctx.generation)
        return []
