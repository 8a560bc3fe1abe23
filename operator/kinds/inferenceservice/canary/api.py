"""`spec.rollout.analysis` and `status.rollout`: the API of automated canary analysis (models only).

The decision itself is `analysis.py` (pure); the queries are `promql.py`. The CEL rules here are checked by
the API server at admission, and by loom.operator.api.cel for objects that never went through it (tests, the SDK).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ....core.model import ApiModel, DnsName, cel, validations

AnalysisMetric = Literal["error-rate", "latency-p99", "ttft-p99", "prometheus"]
ANALYSIS_METRICS: tuple[AnalysisMetric, ...] = ("error-rate", "latency-p99", "ttft-p99", "prometheus")
Verdict = Literal["Waiting", "Analyzing", "Holding", "Promoting", "Promoted", "RolledBack"]
CheckVerdict = Literal["Pass", "Fail", "Missing"]
TrafficSplit = Literal["replica-weighted", "exact"]


class CanaryStep(ApiModel):
    weight: int = Field(ge=1, le=100, description="Percent of traffic the canary gets during this step.")
    pause_seconds: int = Field(
        60, ge=0, le=86400, description="How long the step lasts once the canary is ready; its checks must pass "
        "over it (and at its end) before the next step."
    )


class AnalysisCheck(ApiModel):
    """One check of the canary, evaluated from Prometheus every analysis interval during each step's pause.

    Thresholds: `max`/`min` are absolute bounds on the canary's value; `maxRatioToStable`/`minRatioToStable` bound
    it relative to the stable version's value over the same window (canary <= stable x ratio). Every threshold set
    must hold.
    """

    model_config = validations(
        cel("(self.metric == 'prometheus') == has(self.query)", "query is required for metric prometheus and "
            "only allowed there", field_path=".query"),
        cel("has(self.max) || has(self.min) || has(self.maxRatioToStable) || has(self.minRatioToStable)",
            "set at least one threshold: max, min, maxRatioToStable or minRatioToStable"),
    )  # fmt: skip

    name: DnsName = Field(description="Name of the check, as status and events show it.")
    metric: AnalysisMetric = Field(
        description="error-rate: share of requests answered 5xx (0..1); latency-p99: 99th percentile of request "
        "duration in seconds; ttft-p99: 99th percentile of time to first token in seconds (runtime vllm); "
        "prometheus: the PromQL in query."
    )
    query: str | None = Field(
        None,
        max_length=4096,
        description="PromQL answering one number for one version. Placeholders: {{version}} (the model version), "
        "{{namespace}}, {{pods}} (an RE2 regex of that version's pod names) and {{window}} (e.g. 60s).",
    )
    max: float | None = Field(None, description="The canary fails above this value.")
    min: float | None = Field(None, description="The canary fails below this value.")
    max_ratio_to_stable: float | None = Field(
        None, gt=0, description="The canary fails above stable x this (e.g. 1.2: at most 20% worse than stable)."
    )
    min_ratio_to_stable: float | None = Field(None, gt=0, description="The canary fails below stable x this.")

    @property
    def relative(self) -> bool:
        return self.max_ratio_to_stable is not None or self.min_ratio_to_stable is not None


class Analysis(ApiModel):
    """Automated canary analysis: the canary walks `steps`, judged by `checks`; all pass: the next step, and after
    the last one the canary is promoted; a check fails: it is rolled back at once and its version is never tried
    again (until the annotation loom.dev/canary: retry). Missing metrics never promote: they hold the step, and
    fail it after missingDataSeconds."""

    model_config = validations(
        cel("self.steps.all(s, self.steps.filter(t, t.weight == s.weight).size() == 1)",
            "step weights must increase: a weight appears twice", field_path=".steps"),
        cel("self.steps.map(s, s.weight).isSorted()", "step weights must increase", field_path=".steps"),
        cel("self.checks.all(c, self.checks.filter(d, d.name == c.name).size() == 1)",
            "check names must be unique", field_path=".checks"),
    )  # fmt: skip

    steps: list[CanaryStep] = Field(
        min_length=1, max_length=20, description="Traffic shares in increasing order, e.g. 10, 50, 100 (a last "
        "weight below 100 promotes after its pause)."
    )
    checks: list[AnalysisCheck] = Field(
        default_factory=list, max_length=16, description="What must hold; without checks each step only waits."
    )
    interval_seconds: int = Field(
        30, ge=5, le=600,
        description="How often the checks are evaluated (a step's first evaluation waits for a whole window of it).",
    )
    window_seconds: int = Field(
        60, ge=10, le=3600, description="Range each check's PromQL looks back over (at least two scrapes)."
    )
    missing_data_seconds: int = Field(
        300, ge=0, le=86400, description="How long a check may lack data (holding the step) before it fails."
    )
    failure_limit: int = Field(
        1, ge=1, le=10, description="Failed evaluations of one check that roll back (1: at once). Failures add up over "
        "every step of the analysis, so a flapping check still rolls back."
    )
    promote_alias: str | None = Field(
        "champion", max_length=255, pattern=r"^[A-Za-z0-9_\-]+$",
        description="For a service following an MLflow alias: the alias moved to the promoted version."
    )


class CheckStatus(ApiModel):
    name: str
    verdict: CheckVerdict
    canary: float | None = Field(None, description="The canary's value at the last evaluation.")
    stable: float | None = Field(None, description="The stable version's value (relative thresholds).")
    failures: int = Field(0, description="Failed evaluations in this analysis.")
    missing_since: str | None = Field(None, description="When this check last started lacking data.")
    message: str | None = None


class AnalysisStatus(ApiModel):
    model_version: str = Field(description="The canary's model version under analysis.")
    model_key: str = Field(description="Identity of the canary's model (a digest of its concrete reference).")
    step_index: int = Field(0, ge=0, description="Index of the current step in spec.rollout.analysis.steps.")
    step: str = Field("", description="Current step as n/total (printer column).")
    weight: int = Field(0, description="Traffic share of the current step, in percent.")
    step_started_at: str | None = Field(None, description="When the canary became ready at this step's weight.")
    last_evaluated_at: str | None = None
    verdict: Verdict = "Waiting"
    reason: str = ""
    message: str = ""
    checks: list[CheckStatus] = Field(default_factory=list)


class RejectedVersion(ApiModel):
    model_version: str
    model_key: str
    reason: str
    message: str = ""
    at: str | None = None
    tagged: bool = Field(False, description="The MLflow version carries the rejection tag (loom.dev/rejected).")


class RolloutStatus(ApiModel):
    traffic_split: TrafficSplit = Field(
        "replica-weighted", description="How the canary's share is made: replica-weighted (the Service spreads "
        "connections over the ready replicas of both tracks) or exact (a router in front weighs requests)."
    )
    analysis: AnalysisStatus | None = None
    rejected: list[RejectedVersion] = Field(
        default_factory=list, description="Versions a failed analysis rolled back: never tried again."
    )
    promoted_alias: str | None = Field(
        None, description="The MLflow alias last moved by a promotion, as alias=version."
    )
