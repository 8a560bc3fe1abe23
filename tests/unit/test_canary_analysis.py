"""The canary analysis decision over recorded metric series: pass, fail on errors, fail on latency relative to
stable, missing data (hold, then fail), a flapping metric, overrides, and a restart that resumes from status."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.canary.analysis import (
    Outcome,
    Reading,
    Rejections,
    decide,
    is_due,
    judge,
    seconds_until_due,
)
from loom.operator.kinds.inferenceservice.canary.api import Analysis, AnalysisCheck, AnalysisStatus

T0 = datetime(2026, 11, 26, 2, 0, 0, tzinfo=UTC)
NAN = float("nan")


def analysis(**extra: Any) -> Analysis:
    wire: dict[str, Any] = {
        "steps": [{"weight": 10, "pauseSeconds": 60}, {"weight": 50, "pauseSeconds": 60}, {"weight": 100,
                                                                                          "pauseSeconds": 60}],
        "checks": [
            {"name": "errors", "metric": "error-rate", "max": 0.02},
            {"name": "latency", "metric": "latency-p99", "maxRatioToStable": 1.5},
        ],
        "intervalSeconds": 20,
        "missingDataSeconds": 90,
        **extra,
    }
    return Analysis.model_validate(wire)


Series = Callable[[int, int], dict[str, Reading] | None]  # (seconds since start, step index) -> readings


def healthy(_t: int, _step: int) -> dict[str, Reading]:
    # Recorded from a healthy canary: ~0.4% errors, p99 a little above stable's.
    return {"errors": Reading(0.004), "latency": Reading(0.120, 0.100)}


def play(a: Analysis, series: Series, *, seconds: int = 600, tick: int = 5,
         state: AnalysisStatus | None = None, start: int = 0) -> tuple[list[Outcome], AnalysisStatus | None]:
    """Passes every `tick` seconds (the canary ready throughout); metrics read only when the analysis is due."""
    outcomes: list[Outcome] = []
    for t in range(start, seconds, tick):
        now = T0 + timedelta(seconds=t)
        readings = series(t, state.step_index if state else 0) if is_due(a, state, now) else None
        out = decide(a, state, version="3", key="k3", now=now, canary_ready=True, readings=readings)
        outcomes.append(out)
        state = out.state
        if out.action in ("promote", "rollback"):
            break
    return outcomes, state


def reasons(outcomes: Iterable[Outcome]) -> list[str]:
    return [e.reason for o in outcomes for e in o.events]


def test_healthy_canary_walks_every_step_and_is_promoted() -> None:
    outcomes, state = play(analysis(), healthy)
    assert state is not None and state.verdict == "Promoted" and state.reason == "AnalysisPassed"
    assert outcomes[-1].action == "promote" and outcomes[-1].weight == 100
    weights = [o.weight for o in outcomes]
    assert weights[0] == 10 and 50 in weights and weights[-1] == 100
    assert weights == sorted(weights)  # never back to a lower share
    assert reasons(outcomes) == ["CanaryStarted", "CanaryStep", "CanaryAdvanced", "CanaryStep", "CanaryAdvanced",
                                 "CanaryStep", "CanaryPromoted"]
    # Each step lasted its pause: promoted no sooner than 3 x 60 s after the first step started.
    assert len(outcomes) * 5 >= 180
    assert [c.verdict for c in state.checks] == ["Pass", "Pass"]


def test_error_rate_over_the_bound_rolls_back_at_once_and_names_the_value() -> None:
    def broken(t: int, step: int) -> dict[str, Reading]:
        # Recorded from version 3 answering 25% of its requests with 500 from the second step on.
        return {"errors": Reading(0.25 if step >= 1 else 0.0), "latency": Reading(0.1, 0.1)}

    outcomes, state = play(analysis(), broken)
    assert state is not None and state.verdict == "RolledBack" and state.reason == "CheckFailed"
    last = outcomes[-1]
    assert last.action == "rollback" and last.weight == 0
    assert state.step == "2/3"  # it got through step 1, failed in step 2
    assert "errors: canary 0.25 > max 0.02" in state.message
    assert last.rejected is not None and last.rejected.model_key == "k3" and last.rejected.reason == "CheckFailed"
    assert {"CanaryCheckFailed", "CanaryRolledBack"} <= set(reasons(outcomes))
    assert all(e.type == "Warning" for o in outcomes for e in o.events if e.reason == "CanaryRolledBack")


def test_latency_relative_to_stable() -> None:
    def slow(_t: int, _step: int) -> dict[str, Reading]:
        return {"errors": Reading(0.0), "latency": Reading(0.40, 0.20)}  # twice the stable p99, bound is 1.5x

    _, state = play(analysis(), slow)
    assert state is not None and state.verdict == "RolledBack" and state.step == "1/3"
    assert "latency: canary 0.4 > stable 0.2 x 1.5" in state.message
    # The same canary value passes when stable is as slow: only the ratio matters.
    _, ok = play(analysis(), lambda t, s: {"errors": Reading(0.0), "latency": Reading(0.40, 0.30)})
    assert ok is not None and ok.verdict == "Promoted"


def test_missing_metrics_hold_never_promote_then_fail_after_the_bound() -> None:
    def silent(t: int, _step: int) -> dict[str, Reading]:
        return {"errors": Reading(NAN), "latency": Reading(None, 0.1)}  # no canary traffic at all

    outcomes, state = play(analysis(), silent)
    assert all(o.action != "promote" for o in outcomes)
    held = [o for o in outcomes if o.action == "hold"]
    assert held and all(o.weight == 10 for o in held)  # held at the first step's share
    assert reasons(outcomes).count("CanaryHeld") == 1  # announced once, not every evaluation
    assert state is not None and state.verdict == "RolledBack" and state.reason == "MetricsMissing"
    started = T0 + timedelta(seconds=next(i for i, o in enumerate(outcomes) if o.state.step_started_at) * 5)
    rolled_at = datetime.fromisoformat(str(state.last_evaluated_at).replace("Z", "+00:00"))
    assert (rolled_at - started).total_seconds() >= 90  # not before missingDataSeconds


def test_data_returning_before_the_bound_resumes_the_step() -> None:
    def gap(t: int, _step: int) -> dict[str, Reading]:
        if 40 <= t < 80:  # a scrape gap of 40 s, under the 90 s bound
            return {"errors": Reading(None, error="Prometheus unreachable"), "latency": Reading(None)}
        return healthy(t, _step)

    outcomes, state = play(analysis(), gap)
    assert state is not None and state.verdict == "Promoted"
    assert "hold" in [o.action for o in outcomes]
    assert all(c.missing_since is None for c in state.checks)  # cleared once data came back


def test_a_flapping_metric_never_promotes() -> None:
    flips = iter([0.0, 0.1, 0.0, 0.1, 0.0, 0.1] * 20)

    def flapping(_t: int, _step: int) -> dict[str, Reading]:
        return {"errors": Reading(next(flips)), "latency": Reading(0.1, 0.1)}

    # Even allowing two failures, they add up across the passes in between and across steps.
    outcomes, state = play(analysis(failureLimit=2), flapping)
    assert state is not None and state.verdict == "RolledBack" and state.reason == "CheckFailed"
    assert all(o.action != "promote" for o in outcomes)
    assert [c.failures for c in state.checks if c.name == "errors"] == [2]
    # A step never ends on an evaluation that fails now, whatever the failures so far.
    for o in outcomes:
        if o.action == "advance":
            assert all(c.verdict == "Pass" for c in o.state.checks)


def test_failures_add_up_across_steps() -> None:
    calls = {"n": 0}

    def one_blip_per_step(_t: int, step: int) -> dict[str, Reading]:
        calls["n"] += 1
        first_of_step = calls["n"] == 1 or one_blip_per_step.step != step  # type: ignore[attr-defined]
        one_blip_per_step.step = step  # type: ignore[attr-defined]
        return {"errors": Reading(0.5 if first_of_step else 0.0), "latency": Reading(0.1, 0.1)}

    one_blip_per_step.step = -1  # type: ignore[attr-defined]
    _, state = play(analysis(failureLimit=2), one_blip_per_step, seconds=900)
    assert state is not None and state.verdict == "RolledBack" and state.step == "2/3"
    calls["n"] = 0
    one_blip_per_step.step = -1  # type: ignore[attr-defined]
    _, state = play(analysis(failureLimit=4), one_blip_per_step, seconds=900)
    assert state is not None and state.verdict == "Promoted"  # three blips, four allowed


def test_no_checks_advances_on_time_alone() -> None:
    outcomes, state = play(analysis(checks=[]), lambda t, s: None)
    assert state is not None and state.verdict == "Promoted"
    assert len(outcomes) * 5 >= 180


def test_not_ready_canary_does_not_start_the_pause() -> None:
    a = analysis()
    out = decide(a, None, version="3", key="k3", now=T0, canary_ready=False, readings=None)
    assert out.state.verdict == "Waiting" and out.state.step_started_at is None and out.weight == 10
    later = decide(a, out.state, version="3", key="k3", now=T0 + timedelta(hours=1), canary_ready=True,
                   readings=None)
    assert later.state.step_started_at == "2026-11-26T03:00:00Z"  # the pause starts when the canary is ready


def test_overrides_win_over_any_reading() -> None:
    a = analysis()
    start = decide(a, None, version="3", key="k3", now=T0, canary_ready=True, readings=None)
    promoted = decide(a, start.state, version="3", key="k3", now=T0, canary_ready=True, readings=None,
                      override="promote")
    assert promoted.action == "promote" and promoted.state.reason == "PromotedByAnnotation"
    assert promoted.rejected is None
    aborted = decide(a, start.state, version="3", key="k3", now=T0, canary_ready=True,
                     readings={"errors": Reading(0.0), "latency": Reading(0.1, 0.1)}, override="abort")
    assert aborted.action == "rollback" and aborted.state.reason == "Aborted" and aborted.rejected is not None


def test_final_verdicts_are_sticky_and_a_new_version_starts_afresh() -> None:
    a = analysis()
    _, state = play(a, lambda t, s: {"errors": Reading(1.0), "latency": Reading(0.1, 0.1)})
    assert state is not None and state.verdict == "RolledBack"
    again = decide(a, state, version="3", key="k3", now=T0 + timedelta(hours=2), canary_ready=True,
                   readings={"errors": Reading(0.0), "latency": Reading(0.1, 0.1)})
    assert again.action == "rollback" and again.state == state and again.events == ()
    fresh = decide(a, state, version="4", key="k4", now=T0, canary_ready=True, readings=None)
    assert fresh.state.model_version == "4" and fresh.state.step_index == 0 and fresh.action == "wait"


def test_a_restart_mid_analysis_resumes_from_the_written_status() -> None:
    a = analysis()
    # Run 100 s, then lose everything but the status as written (a wire round-trip), then go on.
    _, mid = play(a, healthy, seconds=100)
    assert mid is not None and mid.verdict == "Analyzing"
    written = AnalysisStatus.model_validate(mid.to_wire())
    outcomes, state = play(a, healthy, state=written, start=100)
    assert state is not None and state.verdict == "Promoted"
    assert "CanaryStarted" not in reasons(outcomes)  # the same analysis, not a new one
    _, uninterrupted = play(a, healthy)
    assert uninterrupted is not None and state.last_evaluated_at == uninterrupted.last_evaluated_at


def test_judge_thresholds() -> None:
    check = AnalysisCheck.model_validate({"name": "x", "metric": "prometheus", "query": "q", "min": 0.9,
                                          "minRatioToStable": 0.95})
    assert judge(check, Reading(0.95, 0.96))[0] == "Pass"
    assert judge(check, Reading(0.85, 0.86))[0] == "Fail"  # under the absolute min
    assert judge(check, Reading(0.91, 1.0))[0] == "Fail"  # under 95% of stable
    assert judge(check, Reading(0.95, None))[0] == "Missing"  # relative needs stable
    errors = AnalysisCheck.model_validate({"name": "e", "metric": "error-rate", "maxRatioToStable": 2})
    assert judge(errors, Reading(0.0, 0.0))[0] == "Pass"
    assert judge(errors, Reading(0.001, 0.0))[0] == "Fail"  # stable answers no error: any error is worse


def test_due_and_next_pass() -> None:
    a = analysis(windowSeconds=30)  # evaluated every 20 s over the last 30 s
    start = decide(a, None, version="3", key="k3", now=T0, canary_ready=True, readings=None)
    # A step's first evaluation waits for a whole window of the step's own data, not only an interval: a window
    # reaching back before the step reads the canary's rate diluted by the time it had no traffic.
    assert not is_due(a, start.state, T0 + timedelta(seconds=20))
    assert is_due(a, start.state, T0 + timedelta(seconds=30))
    assert seconds_until_due(a, start.state, T0 + timedelta(seconds=5)) == 25
    first = decide(a, start.state, version="3", key="k3", now=T0 + timedelta(seconds=30), canary_ready=True,
                   readings=healthy(30, 0))
    assert first.state.last_evaluated_at is not None
    # Then every interval.
    assert not is_due(a, first.state, T0 + timedelta(seconds=45))
    assert is_due(a, first.state, T0 + timedelta(seconds=50))
    assert seconds_until_due(a, first.state, T0 + timedelta(seconds=35)) == 15
    # An interval longer than the window: the first evaluation comes an interval after the step's start.
    slow = analysis(intervalSeconds=40, windowSeconds=30)
    begun = decide(slow, None, version="3", key="k3", now=T0, canary_ready=True, readings=None)
    assert not is_due(slow, begun.state, T0 + timedelta(seconds=30))
    assert is_due(slow, begun.state, T0 + timedelta(seconds=40))
    assert seconds_until_due(a, None, T0) is None


def test_rejections_are_bounded_and_keyed() -> None:
    from loom.operator.kinds.inferenceservice.canary.api import RejectedVersion

    entries: tuple[RejectedVersion, ...] = ()
    for i in range(40):
        entries = Rejections(entries).with_(RejectedVersion(model_version=str(i), model_key=f"k{i}", reason="r"))
    assert len(entries) == 32 and entries[-1].model_key == "k39"
    assert "k39" in Rejections(entries) and "k0" not in Rejections(entries)
    assert "k39" not in Rejections(Rejections(entries).without("k39"))


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"analysis": {"steps": [{"weight": 50}, {"weight": 10}]}}, "step weights must increase"),
        ({"analysis": {"steps": [{"weight": 50}, {"weight": 50}]}}, "step weights must increase"),
        ({"analysis": {"steps": [{"weight": 0}]}}, "greater than or equal to 1"),
        ({"analysis": {"steps": [{"weight": 10}], "checks": [{"name": "a", "metric": "prometheus", "max": 1}]}},
         "query is required for metric prometheus"),
        ({"analysis": {"steps": [{"weight": 10}], "checks": [{"name": "a", "metric": "error-rate"}]}},
         "set at least one threshold"),
        ({"analysis": {"steps": [{"weight": 10}], "checks": [
            {"name": "a", "metric": "error-rate", "max": 1}, {"name": "a", "metric": "latency-p99", "max": 1}]}},
         "check names must be unique"),
        ({"canaryPercent": 10, "analysis": {"steps": [{"weight": 10}]}}, "set canaryPercent or analysis, not both"),
    ],
)
def test_bad_rollouts_are_refused_with_a_clear_message(rollout: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        admitted(InferenceServiceSpec, {"model": {"uri": "s3://m/v"}, "handler": "noop", "rollout": rollout})
