"""The scaling decision: Kubernetes' HPA algorithm as a pure function, plus scale to and from zero.

`decide(config, state, observation)` takes everything it needs as values (the clock included) and
returns a `Decision` carrying the next `ScalingState`; the caller keeps that state between calls. No I/O,
and nothing here knows which kind owns the replicas, so any Deployment-backed kind can reuse it.

The steps follow the HPA controller (pkg/controller/podautoscaler) so its documented behaviour holds:
1. raw recommendation: ratio = value / target; inside the tolerance nothing changes, otherwise
   ceil(ratio x ready pods). Ready pods that reported no sample count as 0 when scaling up and as
   exactly on target when scaling down (HPA's missing-pod rule). Replicas still starting are counted
   as idle capacity before scaling up further, so a slow-loading model does not cause runaway growth.
2. stabilisation: scale up to at most the lowest recommendation of the scale-up window, scale down
   to at least the highest recommendation of the scale-down window.
3. rate limits: each direction's policies (pods or percent per period) over the recorded scale events.
4. bounds: [minReplicas, maxReplicas]; minReplicas 0 means "zero after an idle period".

A metric that is missing or stale never scales anything: the decision holds and says why, so the
caller can raise a condition.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DecisionReason = Literal[
    "ScaledUp",  # desired > current on the metric
    "ScaledDown",
    "WithinTolerance",  # the metric is close enough to the target
    "StabilizingUp",  # a scale-up held back by the scale-up window
    "StabilizingDown",  # a scale-down held back by the scale-down window
    "RateLimited",  # the change was cut by a policy
    "AtMaxReplicas",  # the metric wants more than maxReplicas
    "AtMinReplicas",  # the metric wants fewer than minReplicas (or fewer than 1 while not idle)
    "ReplicasStarting",  # no ready replica to measure yet: hold
    "MetricMissing",  # no sample for any ready replica: hold
    "MetricStale",  # samples too old to trust: hold
    "QueryFailed",  # the metric source could not be asked: hold
    "ScaledToZero",  # idle for the idle period
    "ScaledFromZero",  # activity while at zero
    "Idle",  # at zero and nothing asks for a replica
    "OutOfBounds",  # replicas outside [min, max] (the spec changed): brought back in bounds
]

UnavailableReason = Literal["MetricMissing", "MetricStale", "QueryFailed"]


# A direction's rules as HPAScalingRules bounds them. The API's spec.autoscaling.scaleUp / scaleDown
# (autoscale/spec.py) spells the same rules as the HPA does (Pods, Max) and declares its fields with these.
PolicyValue = Annotated[int, Field(gt=0)]
PolicyPeriodSeconds = Annotated[int, Field(gt=0, le=1800)]
StabilizationWindowSeconds = Annotated[int, Field(ge=0, le=3600)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ScalingPolicy(_Frozen):
    """At most `value` pods, or `value` percent of the replicas at the period's start, per period."""

    type: Literal["pods", "percent"]
    value: PolicyValue
    period_seconds: PolicyPeriodSeconds


class ScalingRules(_Frozen):
    """One direction's behaviour, as in autoscaling/v2 HPAScalingRules."""

    stabilization_window_seconds: StabilizationWindowSeconds
    policies: tuple[ScalingPolicy, ...] = ()
    # max: the policy allowing the biggest change wins; min: the smallest; disabled: never in this direction.
    select_policy: Literal["max", "min", "disabled"] = "max"


# The HPA's defaults: up at once by 4 pods or 100% per 15 s, down after 300 s by up to 100% per 15 s.
DEFAULT_SCALE_UP = ScalingRules(
    stabilization_window_seconds=0,
    policies=(
        ScalingPolicy(type="pods", value=4, period_seconds=15),
        ScalingPolicy(type="percent", value=100, period_seconds=15),
    ),
)
DEFAULT_SCALE_DOWN = ScalingRules(
    stabilization_window_seconds=300, policies=(ScalingPolicy(type="percent", value=100, period_seconds=15),)
)


class ScalingConfig(_Frozen):
    """What to aim for and how fast to move; independent of the kind that owns the replicas."""

    min_replicas: int = Field(ge=0)
    max_replicas: int = Field(ge=1)
    target: float = Field(gt=0, description="Per-replica target of the metric.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while |value/target - 1| <= tolerance.")
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN
    metric_max_age_seconds: float = Field(60, gt=0, description="Older samples are stale: hold.")
    idle_seconds: float = Field(
        300, ge=0, description="With minReplicas 0: no activity for this long scales to zero."
    )
    activation_threshold: float = Field(
        0, ge=0, description="A metric value above this is activity (keeps the service from zero, wakes it)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> ScalingConfig:
        # The decision's own invariant (it clamps to [min, max]) for any config it is given, simulations' included;
        # spec.autoscaling's CEL rule says the same to the person applying the object.
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})")
        return self


class Recommendation(_Frozen):
    at: float
    replicas: int


class ScaleEvent(_Frozen):
    at: float
    change: int  # > 0 up, < 0 down


class ScalingState(_Frozen):
    """What one decision hands to the next: recommendations for the windows, events for the rate limits."""

    recommendations: tuple[Recommendation, ...] = ()
    events: tuple[ScaleEvent, ...] = ()
    last_active_at: float | None = None
    zero_since: float | None = Field(None, description="When this autoscaler took the workload to zero.")

    @classmethod
    def initial(cls, now: float, current_replicas: int) -> ScalingState:
        """State for a workload seen for the first time (or after an operator restart).

        Recording the current replicas as a recommendation means a restart never scales down before a
        full scale-down window has been observed, and counting now as activity means a fresh service is
        not taken to zero before an idle period has passed.
        """
        return cls(recommendations=(Recommendation(at=now, replicas=current_replicas),), last_active_at=now)


class MetricValue(_Frozen):
    """What the metric source saw for the workload.

    per-pod: `value` is the average over `pods` ready pods that reported (HPA's Pods metric).
    workload: `value` is one number for the whole workload, e.g. a user's PromQL (HPA's External metric
    with an AverageValue target): desired = ceil(value / target).
    """

    value: float
    timestamp: float = Field(description="Unix time of the oldest sample the value is made of.")
    scope: Literal["per-pod", "workload"] = "per-pod"
    pods: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _valid(self) -> MetricValue:
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(f"metric value must be finite and >= 0, got {self.value}")
        if self.scope == "per-pod" and self.pods < 1:
            raise ValueError("a per-pod metric value needs at least one reporting pod")
        return self


class MetricUnavailable(_Frozen):
    reason: UnavailableReason
    message: str
    timestamp: float | None = Field(None, description="Newest sample seen, when there was one (stale).")


class Observation(_Frozen):
    now: float
    current_replicas: int = Field(ge=0, description="Replicas asked for now (ready + still starting).")
    ready_replicas: int = Field(ge=0)
    metric: MetricValue | MetricUnavailable
    last_request_at: float | None = Field(
        None,
        description="Newest request seen outside the pods (by the activator): activity, and at zero a wake-up.",
    )


class Decision(_Frozen):
    desired_replicas: int
    current_replicas: int
    reason: DecisionReason
    message: str
    metric_available: bool = Field(description="False: missing, stale or failed metric (raise a condition).")
    metric_value: float | None = None
    metric_timestamp: float | None = None
    state: ScalingState

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas


def decide(config: ScalingConfig, state: ScalingState, obs: Observation) -> Decision:
    """How many replicas the workload should have now; see the module docstring for the steps."""
    now, current, metric = obs.now, obs.current_replicas, obs.metric
    active = isinstance(metric, MetricValue) and metric.value > config.activation_threshold
    last_active = max(
        (t for t in (state.last_active_at, obs.last_request_at, now if active else None) if t is not None),
        default=now,  # never seen: count from now, so a new workload is not idle at once
    )
    state = state.model_copy(update={"last_active_at": last_active})
    low, high = max(config.min_replicas, 1), config.max_replicas

    if current == 0:
        desired, reason, message = _at_zero(config, state, obs, active)
        return _finish(config, state, obs, desired, reason, message, desired or None)
    if isinstance(metric, MetricUnavailable) or obs.ready_replicas == 0:
        # Nothing trustworthy to act on: hold (inside the bounds, which the spec may have moved). Idle time
        # only counts while the metric is seen and says idle, so this time counts as active.
        state = state.model_copy(update={"last_active_at": now})
        held = _clamp(current, low, high)
        hold_reason: DecisionReason
        if isinstance(metric, MetricUnavailable):
            hold_reason, why = metric.reason, metric.message
        else:
            hold_reason, why = "ReplicasStarting", "no replica is ready to measure yet"
        reason = "OutOfBounds" if held != current else hold_reason
        return _finish(config, state, obs, held, reason, f"holding {held} replica(s): {why}", None)

    idle = config.min_replicas == 0 and not active and now - last_active >= config.idle_seconds
    if idle and config.scale_down.select_policy != "disabled":
        # The idle period is this step's stabilisation window; the metric's own windows do not apply.
        return _finish(config, state, obs, 0, "ScaledToZero", f"no activity for {config.idle_seconds:g}s", 0)
    raw, seen = _raw_recommendation(config, current, obs.ready_replicas, metric)
    stabilized = _stabilize(config, state, now, current, raw)
    limited = _rate_limit(config, state, now, current, stabilized)
    desired = _clamp(limited, low, high)
    reason = _reason(current, raw, stabilized, limited, desired)
    message = seen if desired == raw else f"{seen}; recommends {raw}, {_EXPLAIN.get(reason, reason)}"
    return _finish(config, state, obs, desired, reason, message, raw)


_EXPLAIN: dict[DecisionReason, str] = {
    "ScaledUp": "limited by the scale-up policies or maxReplicas",
    "ScaledDown": "limited by the scale-down policies or minReplicas",
    "StabilizingUp": "held by the scale-up stabilization window",
    "StabilizingDown": "held by the scale-down stabilization window",
    "RateLimited": "held by the rate-limit policies",
    "AtMaxReplicas": "bounded by maxReplicas",
    "AtMinReplicas": "bounded by minReplicas (or 1 until the idle period has passed)",
    "WithinTolerance": "within tolerance",
}


def _at_zero(
    config: ScalingConfig, state: ScalingState, obs: Observation, active: bool
) -> tuple[int, DecisionReason, str]:
    if config.min_replicas > 0:
        return config.min_replicas, "OutOfBounds", f"at 0 replicas, below minReplicas {config.min_replicas}"
    request = obs.last_request_at
    if state.zero_since is not None:
        woken = request is not None and request >= state.zero_since
    else:  # went to zero before this state was kept (a restart): only a recent request wakes it
        recent = max(config.idle_seconds, config.metric_max_age_seconds)
        woken = request is not None and obs.now - request < recent
    if not (active or woken):
        return 0, "Idle", "at zero replicas, no activity"
    # One replica first: once it is ready the metric takes over. Rate limits do not apply to it: a held
    # request is waiting for it.
    what = "a request arrived" if woken else "the metric shows activity"
    return 1, "ScaledFromZero", f"{what} while at zero replicas"


def _raw_recommendation(config: ScalingConfig, current: int, ready: int, metric: MetricValue) -> tuple[int, str]:
    """HPA's replica calculation (calcPlainMetricReplicas / external AverageValue) with its fill rules."""
    target = config.target

    def within(ratio: float) -> bool:
        return abs(ratio - 1) <= config.tolerance

    if metric.scope == "workload":
        # One number for the workload: every replica asked for, starting or not, is capacity for it.
        ratio = metric.value / (target * current)
        seen = f"metric {metric.value:.4g} for the workload, target {target:g} per replica"
        return (current, f"{seen}: within tolerance") if within(ratio) else (_ceil(metric.value / target), seen)

    reporting = min(metric.pods, ready)
    missing, pending = ready - reporting, max(current - ready, 0)
    ratio = metric.value / target
    seen = f"metric {metric.value:.4g} per replica over {reporting} ready, target {target:g}"
    if missing == 0 and not (pending and ratio > 1):
        return (current, f"{seen}: within tolerance") if within(ratio) else (_ceil(ratio * reporting), seen)
    # HPA's rule for pods without a sample: idle when the others want more, on target when they want less,
    # so a silent pod never pushes further in the direction the rest are going. Replicas still starting
    # count as idle capacity before scaling up further: a slow-loading model causes no runaway growth.
    total = metric.value * reporting + (target * missing if ratio < 1 else 0.0)
    count = reporting + missing + (pending if ratio > 1 else 0)
    new_ratio = total / (target * count)
    if within(new_ratio) or (ratio < 1 < new_ratio) or (ratio > 1 > new_ratio):
        return current, f"{seen}: holding, counting {missing} silent and {pending} starting replica(s)"
    desired = _ceil(new_ratio * count)
    if (new_ratio < 1 and desired > current) or (new_ratio > 1 and desired < current):
        return current, f"{seen}: holding while {missing} replica(s) report nothing"
    return desired, seen


def _ceil(value: float) -> int:
    # Rounding first keeps 3.0000000000000004 (float noise) from becoming 4.
    return math.ceil(round(value, 9))


def _stabilize(config: ScalingConfig, state: ScalingState, now: float, current: int, raw: int) -> int:
    up_since = now - config.scale_up.stabilization_window_seconds
    down_since = now - config.scale_down.stabilization_window_seconds
    up, down = raw, raw
    for rec in state.recommendations:
        if rec.at > up_since:
            up = min(up, rec.replicas)
        if rec.at > down_since:
            down = max(down, rec.replicas)
    result = current
    if result < up:
        result = up
    if result > down:
        result = down
    return result


def _changed_in(events: tuple[ScaleEvent, ...], now: float, period: int, up: bool) -> int:
    return sum(abs(e.change) for e in events if e.at > now - period and (e.change > 0) == up)


def _rate_limit(config: ScalingConfig, state: ScalingState, now: float, current: int, desired: int) -> int:
    if desired > current:
        rules = config.scale_up
        if rules.select_policy == "disabled":
            return current
        proposals = []
        for p in rules.policies:
            start = current - _changed_in(state.events, now, p.period_seconds, up=True)
            if p.type == "pods":
                proposals.append(start + p.value)
            else:
                proposals.append(_ceil(start * (1 + p.value / 100)))
        if proposals:
            limit = max(proposals) if rules.select_policy == "max" else min(proposals)
            return min(desired, max(limit, current))
    elif desired < current:
        rules = config.scale_down
        if rules.select_policy == "disabled":
            return current
        proposals = []
        for p in rules.policies:
            start = (
                current
                - _changed_in(state.events, now, p.period_seconds, up=True)
                + _changed_in(state.events, now, p.period_seconds, up=False)
            )
            if p.type == "pods":
                proposals.append(start - p.value)
            else:
                proposals.append(math.floor(round(start * (1 - p.value / 100), 9)))
        if proposals:
            limit = min(proposals) if rules.select_policy == "max" else max(proposals)
            return max(desired, min(limit, current))
    return desired


def _reason(current: int, raw: int, stabilized: int, limited: int, desired: int) -> DecisionReason:
    if desired > current:
        return "ScaledUp"
    if desired < current:
        return "ScaledDown"
    if raw > current:
        if stabilized <= current:
            return "StabilizingUp"
        return "RateLimited" if limited <= current else "AtMaxReplicas"
    if raw < current:
        if stabilized >= current:
            return "StabilizingDown"
        return "RateLimited" if limited >= current else "AtMinReplicas"
    return "WithinTolerance"


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


def _finish(
    config: ScalingConfig,
    state: ScalingState,
    obs: Observation,
    desired: int,
    reason: DecisionReason,
    message: str,
    recommendation: int | None,
) -> Decision:
    """The decision, with the state pruned to what the windows and policies can still look at."""
    now = obs.now
    windows = (config.scale_up.stabilization_window_seconds, config.scale_down.stabilization_window_seconds)
    periods = [p.period_seconds for rules in (config.scale_up, config.scale_down) for p in rules.policies]
    recs = tuple(r for r in state.recommendations if r.at > now - max(windows))
    if recommendation is not None:
        recs += (Recommendation(at=now, replicas=recommendation),)
    events = tuple(e for e in state.events if e.at > now - max(periods, default=0))
    zero_since = state.zero_since
    if desired != obs.current_replicas:
        events += (ScaleEvent(at=now, change=desired - obs.current_replicas),)
        zero_since = now if desired == 0 else None
    metric = obs.metric
    # At zero there are no pods, so a per-pod metric is expected to be absent; a failing query is not.
    available = isinstance(metric, MetricValue) or (obs.current_replicas == 0 and metric.reason != "QueryFailed")
    return Decision(
        desired_replicas=desired,
        current_replicas=obs.current_replicas,
        reason=reason,
        message=message,
        metric_available=available,
        metric_value=metric.value if isinstance(metric, MetricValue) else None,
        metric_timestamp=metric.timestamp,
        state=state.model_copy(update={"recommendations": recs, "events": events, "zero_since": zero_since}),
    )
