"""The canary analysis as a condition (pure): `CanaryAnalysis`, True once promoted, False once rolled back,
Unknown while it runs, its reason and message the analysis' own (events come from the analysis, one per step)."""

from __future__ import annotations

from ....core.model import Condition, set_condition
from .api import RolloutStatus

CONDITION = "CanaryAnalysis"


def analysis_condition(conditions: list[Condition], rollout: RolloutStatus, generation: int | None) -> list[Condition]:
    state = rollout.analysis
    if state is None:
        return conditions
    status = {"Promoted": "True", "RolledBack": "False"}.get(state.verdict, "Unknown")
    message = f"{state.model_version} step {state.step} ({state.weight}%): {state.verdict}: {state.message}"
    cond = Condition(type=CONDITION, status=status, reason=state.reason or state.verdict, message=message[:1024],
                     observed_generation=generation)  # fmt: skip
    return set_condition(list(conditions), cond)
