"""Automated canary analysis: what the canary does next, from the last state and the metrics read now (pure).

The state is `status.rollout.analysis` (AnalysisStatus), written by every pass, so an operator killed at any
instant resumes where the last written status left it: a decision is a function of (spec, state, readings, now).
One call is one evaluation:

- a new canary (another model key than the state's): step 1 starts, Waiting until the canary is ready;
- the canary ready at the step's weight for the first time: the step's pause starts (stepStartedAt);
- every `intervalSeconds` the checks are judged (a step's first judgement once a whole `windowSeconds` of the
  step has passed, so that no window reaches back before the step): a value past a threshold counts as a failure
  of that check in this analysis, and `failureLimit` failures roll back (1: at once; failures add up over every
  step, so a flapping check cannot hide behind the passes in between); a check without data holds the step
  (never advances, never promotes) and fails once it lacked data for `missingDataSeconds`;
- the pause over and every check passing now (and none at its failure limit): the next step, or after the last
  one, the promotion.

Overrides (a person's annotation) win over any reading: promote now, abort now. Promoted and RolledBack are final
for that model key: the controller keeps a rolled-back key in status.rollout.rejected and never tries it again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from ....core.kit import Event
from ....core.model import format_time, parse_time
from .api import Analysis, AnalysisCheck, AnalysisStatus, CheckStatus, CheckVerdict, RejectedVersion

Action = Literal["wait", "hold", "advance", "promote", "rollback"]
Override = Literal["promote", "abort"]
FINAL = ("Promoted", "RolledBack")


@dataclass(frozen=True)
class Reading:
    """One check's values now: None when Prometheus has no sample (or NaN: no traffic in the window)."""

    canary: float | None
    stable: float | None = None
    error: str | None = None  # the query failed (Prometheus down): counts as missing data


@dataclass(frozen=True)
class Outcome:
    state: AnalysisStatus
    action: Action
    weight: int  # the canary's traffic share to run now: 100 once promoted, 0 once rolled back
    events: tuple[Event, ...] = ()
    rejected: RejectedVersion | None = None  # set on a rollback: the version never to try again


def model_key(annotation: str) -> str:
    """A short, stable identity of a concrete model reference (its annotation text)."""
    return hashlib.sha256(annotation.encode()).hexdigest()[:16]


def _present(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def judge(check: AnalysisCheck, reading: Reading) -> tuple[CheckVerdict, str]:
    """Pass, Fail or Missing for one reading, and why (values in the message)."""
    if reading.error is not None:
        return "Missing", f"query failed: {reading.error}"
    canary, stable = reading.canary, reading.stable
    if canary is None or not _present(canary):
        return "Missing", "no data for the canary"
    if check.max is not None and canary > check.max:
        return "Fail", f"canary {canary:.4g} > max {check.max:g}"
    if check.min is not None and canary < check.min:
        return "Fail", f"canary {canary:.4g} < min {check.min:g}"
    if check.relative:
        if stable is None or not _present(stable):
            return "Missing", "no data for the stable version"
        if check.max_ratio_to_stable is not None and canary > stable * check.max_ratio_to_stable:
            return "Fail", f"canary {canary:.4g} > stable {stable:.4g} x {check.max_ratio_to_stable:g}"
        if check.min_ratio_to_stable is not None and canary < stable * check.min_ratio_to_stable:
            return "Fail", f"canary {canary:.4g} < stable {stable:.4g} x {check.min_ratio_to_stable:g}"
    return "Pass", f"canary {canary:.4g}" + (f", stable {stable:.4g}" if check.relative and stable is not None else "")


def new_state(analysis: Analysis, version: str, key: str) -> AnalysisStatus:
    first = analysis.steps[0]
    return AnalysisStatus(
        model_version=version, model_key=key, step_index=0, step=f"1/{len(analysis.steps)}", weight=first.weight,
        verdict="Waiting", reason="CanaryStarting", message=f"waiting for the canary {version} to be ready",
    )  # fmt: skip


def _wait_seconds(analysis: Analysis, state: AnalysisStatus) -> float:
    """Between evaluations, an interval; before a step's first, a whole window too, so that the first evaluation of
    a step never looks back before the step (a rate over a window half of which came before the canary had traffic
    reads half the canary's rate: a healthy canary was rolled back on it, at load)."""
    if state.last_evaluated_at is None:
        return float(max(analysis.interval_seconds, analysis.window_seconds))
    return float(analysis.interval_seconds)


def is_due(analysis: Analysis, state: AnalysisStatus | None, now: datetime) -> bool:
    """Whether this pass should read the metrics: a running step whose last evaluation (or its start) is old
    enough (`_wait_seconds`)."""
    if state is None or state.verdict in FINAL or state.step_started_at is None:
        return False
    last = parse_time(state.last_evaluated_at) or parse_time(state.step_started_at)
    return last is None or (now - last).total_seconds() >= _wait_seconds(analysis, state) - 0.5


def seconds_until_due(analysis: Analysis, state: AnalysisStatus | None, now: datetime) -> float | None:
    """When the next pass should come for this analysis (None: nothing to wait for)."""
    if state is None or state.verdict in FINAL:
        return None
    last = parse_time(state.last_evaluated_at) or parse_time(state.step_started_at)
    if last is None:
        return float(analysis.interval_seconds)
    return max(1.0, _wait_seconds(analysis, state) - (now - last).total_seconds())


def decide(
    analysis: Analysis,
    previous: AnalysisStatus | None,
    *,
    version: str,
    key: str,
    now: datetime,
    canary_ready: bool,
    readings: Mapping[str, Reading] | None,
    override: Override | None = None,
) -> Outcome:
    """The next state and action. `readings` None: the metrics were not read this pass (not due)."""
    events: list[Event] = []
    state = previous if previous is not None and previous.model_key == key else None
    if state is None:
        state = new_state(analysis, version, key)
        weights = ", ".join(f"{s.weight}%" for s in analysis.steps)
        events.append(Event("Normal", "CanaryStarted", f"canary {version}: analysis over steps {weights}"))
    if state.verdict == "Promoted":
        return Outcome(state, "promote", 100, tuple(events))
    if state.verdict == "RolledBack":
        return Outcome(state, "rollback", 0, tuple(events))
    stamp = format_time(now)
    if override == "abort":
        return _rollback(state, stamp, "Aborted", "aborted by the annotation loom.dev/canary: abort", events)
    if override == "promote":
        return _promote(state, stamp, "PromotedByAnnotation", "promoted by the annotation loom.dev/canary: promote",
                        events)  # fmt: skip
    step = analysis.steps[state.step_index]
    if not canary_ready:
        message = f"waiting for the canary {version} at {step.weight}% to be ready"
        waiting = state.model_copy(update={"verdict": "Waiting", "reason": "CanaryNotReady", "message": message})
        return Outcome(waiting, "wait", step.weight, tuple(events))  # fmt: skip
    if state.step_started_at is None:
        state = state.model_copy(update={
            "step_started_at": stamp, "last_evaluated_at": None, "verdict": "Analyzing", "reason": "StepStarted",
            "message": f"step {state.step}: {step.weight}% of traffic to {version} for {step.pause_seconds}s",
        })  # fmt: skip
        events.append(Event("Normal", "CanaryStep", state.message))
        readings = None  # the pause starts now; the first evaluation comes an interval later
    if readings is None:
        return _after_pause_without_checks(analysis, state, now, stamp, events)
    return _evaluate(analysis, state, readings, now, stamp, events)


def _after_pause_without_checks(
    analysis: Analysis, state: AnalysisStatus, now: datetime, stamp: str, events: list[Event]
) -> Outcome:
    # Only a step without checks moves on time alone; with checks the move waits for an evaluation.
    if not analysis.checks and _pause_over(analysis, state, now):
        return _next(analysis, state, stamp, events)
    return Outcome(state, "wait", state.weight, tuple(events))


def _pause_over(analysis: Analysis, state: AnalysisStatus, now: datetime) -> bool:
    started = parse_time(state.step_started_at)
    return started is not None and (now - started).total_seconds() >= analysis.steps[state.step_index].pause_seconds


def _evaluate(
    analysis: Analysis,
    state: AnalysisStatus,
    readings: Mapping[str, Reading],
    now: datetime,
    stamp: str,
    events: list[Event],
) -> Outcome:
    before = {c.name: c for c in state.checks}
    checks: list[CheckStatus] = []
    failed: list[str] = []
    expired: list[str] = []
    missing: list[str] = []
    for check in analysis.checks:
        prior = before.get(check.name)
        verdict, message = judge(check, readings.get(check.name, Reading(None, error="not queried")))
        failures = (prior.failures if prior else 0) + (verdict == "Fail")
        missing_since = None
        if verdict == "Missing":
            missing_since = (prior.missing_since if prior and prior.missing_since else None) or stamp
            lacking = (now - (parse_time(missing_since) or now)).total_seconds()
            if lacking >= analysis.missing_data_seconds:
                expired.append(f"{check.name}: {message} for {lacking:.0f}s")
            else:
                missing.append(f"{check.name}: {message}")
        reading = readings.get(check.name)
        checks.append(CheckStatus(
            name=check.name, verdict=verdict, canary=_finite(reading.canary if reading else None),
            stable=_finite(reading.stable if reading else None), failures=failures, missing_since=missing_since,
            message=message,
        ))  # fmt: skip
        if verdict == "Fail":
            events.append(Event("Warning", "CanaryCheckFailed", f"check {check.name} failed ({failures} of "
                                f"{analysis.failure_limit} allowed): {message}"))  # fmt: skip
        if failures >= analysis.failure_limit:
            failed.append(f"{check.name}: {message}")
    state = state.model_copy(update={"checks": checks, "last_evaluated_at": stamp})
    if failed:
        return _rollback(state, stamp, "CheckFailed", "; ".join(failed), events)
    if expired:
        return _rollback(state, stamp, "MetricsMissing", "; ".join(expired), events)
    if missing:
        message = f"step {state.step} held: " + "; ".join(missing)
        if state.verdict != "Holding":
            events.append(Event("Normal", "CanaryHeld", message))
        held = state.model_copy(update={"verdict": "Holding", "reason": "MetricsMissing", "message": message})
        return Outcome(held, "hold", state.weight, tuple(events))
    passing = all(c.verdict == "Pass" for c in checks)
    if passing and _pause_over(analysis, state, now):
        return _next(analysis, state, stamp, events)
    running = state.model_copy(update={
        "verdict": "Analyzing", "reason": "ChecksPassing" if passing else "CheckFailedOnce",
        "message": f"step {state.step}: {state.weight}% to {state.model_version}; "
                   + ("; ".join(f"{c.name} {c.message}" for c in checks) or "no checks"),
    })  # fmt: skip
    return Outcome(running, "wait", state.weight, tuple(events))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _next(analysis: Analysis, state: AnalysisStatus, stamp: str, events: list[Event]) -> Outcome:
    if state.step_index + 1 >= len(analysis.steps):
        return _promote(state, stamp, "AnalysisPassed", f"every check passed over {len(analysis.steps)} step(s)",
                        events)  # fmt: skip
    index = state.step_index + 1
    step = analysis.steps[index]
    advanced = state.model_copy(update={
        "step_index": index, "step": f"{index + 1}/{len(analysis.steps)}", "weight": step.weight,
        "step_started_at": None, "last_evaluated_at": None, "verdict": "Waiting",
        "reason": "StepAdvanced", "message": f"step {index + 1}/{len(analysis.steps)}: {step.weight}% of traffic "
        f"to {state.model_version}, waiting for the canary to be ready",
    })  # fmt: skip
    events.append(Event("Normal", "CanaryAdvanced", advanced.message))
    return Outcome(advanced, "advance", step.weight, tuple(events))


def _promote(state: AnalysisStatus, stamp: str, reason: str, message: str, events: list[Event]) -> Outcome:
    done = state.model_copy(update={"verdict": "Promoted", "reason": reason, "weight": 100,
                                    "message": f"{state.model_version} promoted: {message}",
                                    "last_evaluated_at": state.last_evaluated_at or stamp})  # fmt: skip
    events.append(Event("Normal", "CanaryPromoted", done.message))
    return Outcome(done, "promote", 100, tuple(events))


def _rollback(state: AnalysisStatus, stamp: str, reason: str, message: str, events: list[Event]) -> Outcome:
    done = state.model_copy(update={"verdict": "RolledBack", "reason": reason, "weight": 0,
                                    "message": f"{state.model_version} rolled back: {message}",
                                    "last_evaluated_at": stamp})  # fmt: skip
    events.append(Event("Warning", "CanaryRolledBack", done.message))
    rejected = RejectedVersion(
        model_version=state.model_version, model_key=state.model_key, reason=reason, message=message[:1024], at=stamp
    )
    return Outcome(done, "rollback", 0, tuple(events), rejected)


@dataclass(frozen=True)
class Rejections:
    """The rejected list kept bounded (newest last): a version once rolled back is never tried again."""

    entries: tuple[RejectedVersion, ...] = field(default_factory=tuple)
    limit: int = 32

    def with_(self, entry: RejectedVersion) -> tuple[RejectedVersion, ...]:
        kept = [e for e in self.entries if e.model_key != entry.model_key]
        return tuple([*kept, entry][-self.limit :])

    def without(self, key: str) -> tuple[RejectedVersion, ...]:
        return tuple(e for e in self.entries if e.model_key != key)

    def __contains__(self, key: object) -> bool:
        return any(e.model_key == key for e in self.entries)
