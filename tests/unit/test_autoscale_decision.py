"""The scaling decision over recorded metric series: spike, oscillation, outages, bounds, pending replicas, zero."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from loom.operator.autoscale.decision import (
    Decision,
    MetricUnavailable,
    MetricValue,
    Observation,
    ScaleEvent,
    ScalingConfig,
    ScalingPolicy,
    ScalingRules,
    ScalingState,
    decide,
)

T0 = 1_700_000_000.0


def config(**overrides: object) -> ScalingConfig:
    base: dict[str, object] = {"min_replicas": 1, "max_replicas": 10, "target": 100.0}
    base.update(overrides)
    return ScalingConfig.model_validate(base)


def per_pod(value: float, pods: int, at: float) -> MetricValue:
    return MetricValue(value=value, timestamp=at, scope="per-pod", pods=pods)


def once(
    cfg: ScalingConfig,
    *,
    current: int,
    metric: MetricValue | MetricUnavailable,
    ready: int | None = None,
    state: ScalingState | None = None,
    now: float = T0,
    last_request_at: float | None = None,
) -> Decision:
    obs = Observation(
        now=now,
        current_replicas=current,
        ready_replicas=current if ready is None else ready,
        metric=metric,
        last_request_at=last_request_at,
    )
    return decide(cfg, state or ScalingState(), obs)


@dataclass
class Cluster:
    """Replays a load series: the autoscaler decides every `step` s; new replicas are Ready after `load_s`."""

    cfg: ScalingConfig
    replicas: int
    load_s: float = 0.0
    step: float = 15.0
    now: float = T0
    started: list[float] = field(default_factory=list)  # when each not-yet-ready replica was asked for
    history: list[tuple[float, int]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    state: ScalingState = field(default_factory=ScalingState)
    last_request_at: float | None = None

    def ready(self) -> int:
        starting = sum(1 for t in self.started if self.now - t < self.load_s)
        return max(self.replicas - starting, 0)

    def run(self, seconds: float, total_load: Callable[[float], float | None]) -> None:
        """total_load(t): work across the workload (per-replica value = load / ready); None: no metric."""
        end = self.now + seconds
        while self.now < end:
            ready = self.ready()
            load = total_load(self.now - T0)
            metric: MetricValue | MetricUnavailable
            if load is None:
                metric = MetricUnavailable(reason="MetricMissing", message="exporter down")
            elif ready == 0:
                metric = MetricUnavailable(reason="MetricMissing", message="no pods")
            else:
                metric = per_pod(load / ready, ready, self.now - 5)
            obs = Observation(
                now=self.now, current_replicas=self.replicas, ready_replicas=ready, metric=metric,
                last_request_at=self.last_request_at,
            )
            d = decide(self.cfg, self.state, obs)
            self.decisions.append(d)
            self.state = d.state
            if d.desired_replicas > self.replicas:
                self.started += [self.now] * (d.desired_replicas - self.replicas)
            self.replicas = d.desired_replicas
            self.history.append((self.now - T0, self.replicas))
            self.now += self.step

    def direction_changes(self) -> list[float]:
        """Times at which the scaling direction reversed."""
        changes, last_dir, prev = [], 0, None
        for t, n in self.history:
            if prev is not None and n != prev:
                direction = 1 if n > prev else -1
                if last_dir and direction != last_dir:
                    changes.append(t)
                last_dir = direction
            prev = n
        return changes


def test_spike_scales_up_at_once_then_down_only_after_the_window() -> None:
    sim = Cluster(config(), replicas=2)
    spike = lambda t: 450.0 if 60 <= t < 120 else 150.0  # noqa: E731 (a recorded series)
    sim.run(600, spike)
    at = dict(sim.history)
    assert at[45] == 2  # 75 per replica: ceil(2 x 0.75) = 2
    assert at[60] == 5  # 450 / 100 -> 5, in one step (4 pods or 100% per 15 s allows 4)
    # The last spike sample is at 105 s; the 300 s scale-down window holds 5 until 105 + 300.
    assert all(n == 5 for t, n in sim.history if 60 <= t < 405)
    assert at[405] == 2
    reasons = {d.reason for d in sim.decisions[9:27]}
    assert "StabilizingDown" in reasons


def test_a_small_deviation_inside_the_tolerance_changes_nothing() -> None:
    d = once(config(), current=4, metric=per_pod(109.0, 4, T0))
    assert (d.desired_replicas, d.reason) == (4, "WithinTolerance")
    d = once(config(), current=4, metric=per_pod(111.0, 4, T0))
    assert (d.desired_replicas, d.reason) == (5, "ScaledUp")
    d = once(config(tolerance=0.2), current=4, metric=per_pod(119.0, 4, T0))
    assert d.desired_replicas == 4


def test_desired_is_ceil_of_ready_times_value_over_target() -> None:
    unlimited = config(max_replicas=100, scale_up=ScalingRules(stabilization_window_seconds=0))
    d = once(unlimited, current=3, metric=per_pod(250.0, 3, T0))
    assert d.desired_replicas == 8  # ceil(3 x 250 / 100)
    assert d.metric_value == 250.0 and d.metric_timestamp == T0 and d.metric_available
    # HPA's default policies allow at most +4 pods (or +100%) per 15 s: 7 now, 8 recommended.
    d = once(config(), current=3, metric=per_pod(250.0, 3, T0))
    assert (d.desired_replicas, d.state.recommendations[-1].replicas) == (7, 8)
    assert "recommends 8" in d.message


def test_oscillation_around_the_target_changes_direction_at_most_once_per_window() -> None:
    # Work alternates between 1.3x and 0.7x of what 3 replicas handle, every 30 s, for 30 minutes.
    def oscillating(t: float) -> float:
        return 300.0 * (1.3 if int(t // 30) % 2 == 0 else 0.7)

    sim = Cluster(config(), replicas=3)
    sim.run(1800, oscillating)
    window = sim.cfg.scale_down.stabilization_window_seconds
    changes = sim.direction_changes()
    assert all(b - a >= window for a, b in itertools.pairwise(changes))
    assert changes == []  # up once to 4 for the peaks, then held: no flapping at all
    assert {n for _, n in sim.history} == {4}

    # The same series without a scale-down window flaps: the window is what prevents it.
    no_window = config(scale_down=ScalingRules(stabilization_window_seconds=0, policies=()))
    flappy = Cluster(no_window, replicas=3)
    flappy.run(1800, oscillating)
    assert len(flappy.direction_changes()) > 10


def test_missing_metric_holds_and_says_why() -> None:
    sim = Cluster(config(), replicas=6)
    sim.run(900, lambda t: None)  # the exporter is down for 15 minutes
    assert {n for _, n in sim.history} == {6}
    last = sim.decisions[-1]
    assert (last.reason, last.metric_available) == ("MetricMissing", False)
    assert "exporter down" in last.message
    # Holding records no recommendation: a stale recommendation must not drive a later decision.
    assert last.state.recommendations == ()


def test_metric_outage_after_low_load_never_scales_down() -> None:
    sim = Cluster(config(), replicas=6)
    sim.run(300, lambda t: 600.0)
    sim.run(900, lambda t: None)
    assert sim.replicas == 6
    # Back with low load: the usual scale-down window applies from then on (no recommendations kept).
    sim.run(30, lambda t: 100.0)
    assert sim.replicas == 1


def test_stale_metric_holds() -> None:
    stale = MetricUnavailable(reason="MetricStale", message="newest sample is 400s old", timestamp=T0 - 400)
    d = once(config(), current=5, metric=stale)
    assert (d.desired_replicas, d.reason, d.metric_available) == (5, "MetricStale", False)
    assert d.metric_timestamp == T0 - 400


def test_bounds() -> None:
    cfg = config(min_replicas=2, max_replicas=5)
    up = once(cfg, current=5, metric=per_pod(900.0, 5, T0))
    assert (up.desired_replicas, up.reason) == (5, "AtMaxReplicas")
    partly = once(cfg, current=3, metric=per_pod(900.0, 3, T0))
    assert (partly.desired_replicas, partly.reason) == (5, "ScaledUp")
    down = once(cfg, current=2, metric=per_pod(1.0, 2, T0))
    assert (down.desired_replicas, down.reason) == (2, "AtMinReplicas")
    # The spec moved the bounds: replicas come back inside them even while the metric is missing.
    missing = MetricUnavailable(reason="MetricMissing", message="none")
    assert once(cfg, current=9, metric=missing).desired_replicas == 5
    assert once(cfg, current=9, metric=missing).reason == "OutOfBounds"
    assert once(cfg, current=1, metric=missing).desired_replicas == 2


def test_pending_replicas_prevent_runaway_scale_up_of_a_slow_loading_model() -> None:
    # 500 units of work, 100 per replica: 5 replicas are enough, however long they take to load.
    sim = Cluster(config(max_replicas=50), replicas=1, load_s=180)
    sim.run(600, lambda t: 500.0)
    assert max(n for _, n in sim.history) == 5
    assert sim.history[-1][1] == 5
    # It got there in one step and then held while they loaded.
    assert [n for _, n in sim.history[:13]] == [5] * 13


def test_pending_replicas_absorb_a_small_rise_and_not_a_big_one() -> None:
    # 4 asked for, 2 ready at 180 each: 360 in all, which the 4 will handle (90 each).
    d = once(config(), current=4, ready=2, metric=per_pod(180.0, 2, T0))
    assert d.desired_replicas == 4
    # 250 each on 2 ready: 500, more than 4 can handle: 5.
    d = once(config(), current=4, ready=2, metric=per_pod(250.0, 2, T0))
    assert d.desired_replicas == 5


def test_no_ready_replica_holds() -> None:
    d = once(config(), current=3, ready=0, metric=per_pod(500.0, 1, T0))
    assert (d.desired_replicas, d.reason) == (3, "ReplicasStarting")


def test_silent_ready_pods_never_push_further_in_the_direction_of_the_rest() -> None:
    # 1 of 3 ready pods reported 200: the two silent ones count as idle -> 200 over 3 = 67% -> hold.
    d = once(config(), current=3, metric=per_pod(200.0, 1, T0))
    assert d.desired_replicas == 3
    # 1 of 3 reported 10: the silent ones count as on target -> (10 + 200) / 3 = 70% -> ceil(2.1) = 3.
    d = once(config(), current=3, metric=per_pod(10.0, 1, T0))
    assert d.desired_replicas == 3
    # All three report 10: scale down.
    assert once(config(scale_down=ScalingRules(stabilization_window_seconds=0, policies=())),
                current=3, metric=per_pod(10.0, 3, T0)).desired_replicas == 1


def test_scale_up_rate_limit_pods_per_period() -> None:
    cfg = config(
        max_replicas=100,
        scale_up=ScalingRules(
            stabilization_window_seconds=0, policies=(ScalingPolicy(type="pods", value=2, period_seconds=60),)
        ),
    )
    sim = Cluster(cfg, replicas=1)
    sim.run(300, lambda t: 1000.0)
    at = dict(sim.history)
    assert at[0] == 3  # +2
    assert at[15] == 3 and at[45] == 3  # no more within the same 60 s
    assert at[60] == 5
    assert at[120] == 7
    assert sim.decisions[1].reason == "RateLimited"


def test_scale_up_rate_limit_percent_and_select_policy() -> None:
    percent = ScalingPolicy(type="percent", value=50, period_seconds=60)
    pods = ScalingPolicy(type="pods", value=1, period_seconds=60)
    most = config(max_replicas=100, scale_up=ScalingRules(stabilization_window_seconds=0, policies=(percent, pods)))
    assert once(most, current=4, metric=per_pod(1000.0, 4, T0)).desired_replicas == 6  # max(4*1.5, 4+1)
    least = most.model_copy(update={"scale_up": most.scale_up.model_copy(update={"select_policy": "min"})})
    assert once(least, current=4, metric=per_pod(1000.0, 4, T0)).desired_replicas == 5
    frozen = most.model_copy(update={"scale_up": most.scale_up.model_copy(update={"select_policy": "disabled"})})
    assert once(frozen, current=4, metric=per_pod(1000.0, 4, T0)).desired_replicas == 4
    # Earlier events in the period count against it.
    state = ScalingState(events=(ScaleEvent(at=T0 - 30, change=2),))
    assert once(most, current=6, metric=per_pod(1000.0, 6, T0), state=state).desired_replicas == 6


def test_scale_down_rate_limit() -> None:
    cfg = config(
        scale_down=ScalingRules(
            stabilization_window_seconds=0, policies=(ScalingPolicy(type="pods", value=1, period_seconds=30),)
        )
    )
    sim = Cluster(cfg, replicas=8)
    sim.run(240, lambda t: 100.0)
    at = dict(sim.history)
    assert [at[t] for t in (0, 15, 30, 60, 90)] == [7, 7, 6, 5, 4]


def test_scales_to_zero_after_the_idle_period_and_back_on_a_request() -> None:
    cfg = config(min_replicas=0, idle_seconds=120)
    sim = Cluster(cfg, replicas=2, load_s=30)
    sim.state = ScalingState.initial(T0, 2)
    sim.run(60, lambda t: 50.0)  # some load: stays up
    assert sim.replicas >= 1
    sim.run(300, lambda t: 0.0)  # idle
    at = dict(sim.history)
    # The last busy sample was at 45 s: not before 45 + 120 s.
    assert at[60] >= 1 and at[150] >= 1
    assert at[165] == 0
    assert sim.decisions[11].reason == "ScaledToZero"
    assert {d.reason for d in sim.decisions[12:]} == {"Idle"}
    # At zero there are no pods to measure: that is not a metric problem.
    assert sim.decisions[-1].metric_available

    # A request held by the activator wakes it with one replica, at once.
    sim.last_request_at = sim.now - 1
    sim.run(15, lambda t: 0.0)
    assert sim.replicas == 1 and sim.decisions[-1].reason == "ScaledFromZero"
    # While it loads (30 s) it holds, and its loading time does not count as idle.
    sim.run(30, lambda t: 0.0)
    assert sim.replicas == 1
    sim.run(60, lambda t: 80.0)  # the request is served
    assert sim.replicas == 1


def test_an_old_request_does_not_wake_a_service_at_zero() -> None:
    cfg = config(min_replicas=0, idle_seconds=60)
    state = ScalingState(zero_since=T0 - 100, last_active_at=T0 - 200)
    missing = MetricUnavailable(reason="MetricMissing", message="no pods")
    d = once(cfg, current=0, metric=missing, state=state, last_request_at=T0 - 150)
    assert (d.desired_replicas, d.reason) == (0, "Idle")
    d = once(cfg, current=0, metric=missing, state=state, last_request_at=T0 - 10)
    assert (d.desired_replicas, d.reason) == (1, "ScaledFromZero")


def test_a_workload_metric_wakes_from_zero_and_scales_on_its_total() -> None:
    cfg = config(min_replicas=0)
    busy = MetricValue(value=350.0, timestamp=T0, scope="workload")
    d = once(cfg, current=0, metric=busy, state=ScalingState(zero_since=T0 - 500))
    assert (d.desired_replicas, d.reason) == (1, "ScaledFromZero")
    d = once(cfg, current=1, metric=busy, state=d.state, now=T0 + 60)
    assert d.desired_replicas == 4  # ceil(350 / 100)


def test_min_replicas_above_zero_never_goes_to_zero() -> None:
    sim = Cluster(config(min_replicas=1, idle_seconds=0), replicas=1)
    sim.run(600, lambda t: 0.0)
    assert {n for _, n in sim.history} == {1}


def test_a_restart_does_not_scale_down_before_a_full_window() -> None:
    state = ScalingState.initial(T0, 6)
    d = once(config(), current=6, metric=per_pod(10.0, 6, T0 + 60), state=state, now=T0 + 60)
    assert (d.desired_replicas, d.reason) == (6, "StabilizingDown")
    d = once(config(), current=6, metric=per_pod(10.0, 6, T0 + 301), state=d.state, now=T0 + 301)
    assert d.desired_replicas == 1


def test_state_is_pruned_to_what_the_windows_can_see() -> None:
    sim = Cluster(config(), replicas=2)
    sim.run(3600, lambda t: 200.0 if (t // 400) % 2 else 100.0)
    newest = sim.now - sim.step
    window = sim.cfg.scale_down.stabilization_window_seconds
    assert all(r.at > newest - window for r in sim.state.recommendations)
    assert all(e.at > newest - 15 for e in sim.state.events)


def test_bad_configuration_is_rejected_with_a_clear_message() -> None:
    with pytest.raises(ValidationError, match="minReplicas \\(5\\) must be <= maxReplicas \\(2\\)"):
        config(min_replicas=5, max_replicas=2)
    with pytest.raises(ValidationError):
        config(target=0)
    with pytest.raises(ValidationError, match="finite"):
        MetricValue(value=float("nan"), timestamp=T0, pods=1)
    with pytest.raises(ValidationError, match="reporting pod"):
        MetricValue(value=1.0, timestamp=T0, scope="per-pod", pods=0)


@pytest.mark.parametrize("seed", range(20))
def test_random_load_respects_windows_rate_limits_and_bounds(seed: int) -> None:
    """Over noisy random loads: no scale-down below a replica count recommended within the down window,
    no more than the policies allow per period, never outside [min, max]."""
    import random

    rng = random.Random(seed)
    cfg = config(
        min_replicas=2,
        max_replicas=12,
        scale_up=ScalingRules(
            stabilization_window_seconds=30, policies=(ScalingPolicy(type="pods", value=3, period_seconds=60),)
        ),
        scale_down=ScalingRules(
            stabilization_window_seconds=120, policies=(ScalingPolicy(type="percent", value=50, period_seconds=60),)
        ),
    )
    level = rng.uniform(100, 1000)

    def load(t: float) -> float | None:
        nonlocal level
        level = min(1300.0, max(50.0, level + rng.gauss(0, 150)))
        return None if rng.random() < 0.05 else level  # now and then the metric is missing

    sim = Cluster(cfg, replicas=2, load_s=rng.choice([0, 20, 45]))
    sim.run(3600, load)
    replicas = [n for _, n in sim.history]
    assert all(2 <= n <= 12 for n in replicas)
    before, downs = 2, 0
    for (t, n), d in zip(sim.history, sim.decisions, strict=True):
        recent = [r.replicas for r in d.state.recommendations if t + T0 - r.at < 120]
        if n < before:
            # A scale-down never goes below what any recommendation in the down window asked for.
            assert n >= max(recent)
            downs += 1
        added = sum(n2 - n1 for (t1, n1), (t2, n2) in itertools.pairwise(sim.history) if n2 > n1 and t - 60 < t2 <= t)
        assert added <= 3
        before = n
    assert downs > 0 and max(replicas) > 2  # the series did move both ways
