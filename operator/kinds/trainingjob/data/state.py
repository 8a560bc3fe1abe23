"""The TrainingJob state machine's training-data transitions (pure; state.py runs them through decision.Machine).

spec.trainingData: no worker starts before the training set is built (a Job, retrieval.py); while the FeatureView is
missing or unregistered, or the Job runs, the job is Pending with condition TrainingDataReady=False naming why. A
failed retrieval fails the job (TrainingDataFailed) with the workload's reason and Feast's message. Once built
(status.trainingData.phase Succeeded) it is never rebuilt: restarts and resumes reuse it.
"""

from __future__ import annotations

from ..decision import Decision, Machine
from .api import TrainingDataStatus
from .retrieval import CONDITION, DataObservation


def built(m: Machine) -> bool:
    return m.st.training_data is not None and m.st.training_data.phase == "Succeeded"


def training_data(m: Machine) -> Decision | None:
    """Wait for (or fail on) the training set; None once it is built and the workers may start."""
    data = m.obs.training_data
    if data is None:
        # The controller had nothing to say this pass (it only looks while the set is not built).
        pending = m.st.training_data or TrainingDataStatus(phase="Pending")
        data = DataObservation("Waiting", "Pending", "looking up the FeatureView", pending)
    m.st.training_data = data.status
    if data.state == "Succeeded":
        m.event("Normal", "TrainingDataReady", data.message)
        return None
    m.data_detail = (data.reason, data.message)
    if data.state == "Failed":
        return m.finish("Failed", "TrainingDataFailed", f"{data.reason}: {data.message}")
    m.st.phase = "Pending"
    m.reason_detail = (data.reason, data.message)
    return m.conclude()


def data_condition(m: Machine) -> tuple[bool, str, str]:
    """TrainingDataReady: (status, reason, message)."""
    data = m.st.training_data
    if data is not None and data.phase == "Succeeded":
        return True, "Retrieved", f"{data.rows} rows at {data.output}"
    # A finished job keeps the reason retrieval failed with; passes after it observe nothing new.
    old = next((c for c in m.st.conditions if c.type == CONDITION), None)
    kept = (old.reason, old.message) if old is not None else None
    reason, message = m.data_detail or kept or ("Pending", "the training set is not built yet")
    return False, reason, message
