"""A TrainingJob's conditions from one step of its state machine (pure; state.py concludes every step with them).

One condition per phase (Created, Running, Restarting, Suspended, Succeeded, Failed) and Ready, each True while the
job is in it, with the reason and message the step gave; then what its features add: TrainingDataReady
(spec.trainingData, data/state.py), Admitted (queued by Kueue, queue/state.py) and CheckpointStorage (storage.py).
"""

from __future__ import annotations

from ...core.kit import Condition, set_condition
from ...core.model import ConditionStatus
from ...core.pod_problems import REASONS as POD_REASONS
from .data.retrieval import CONDITION as DATA_CONDITION
from .data.state import data_condition
from .decision import Machine
from .queue.state import ADMITTED_CONDITION, admitted_condition
from .storage import CONDITION as STORAGE_CONDITION
from .storage import RETRYING, storage_condition

CONDITION_TYPES = ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "Ready")


def set_conditions(m: Machine) -> None:
    st, gen, now = m.st, m.obs.generation, m.obs.now
    phase = st.phase or "Pending"
    reason, message = m.reason_detail or (phase, "")
    created = st.start_time is not None or phase not in ("Pending", "Queued")
    table: dict[str, tuple[bool, str, str]] = {
        "Created": (created, "WorkersCreated", "worker pods created") if created else (False, reason, message),
        "Running": (phase == "Running", "WorkersRunning" if phase == "Running" else reason, message),
    }
    for kind in ("Restarting", "Suspended", "Succeeded", "Failed"):
        table[kind] = (True, reason, message) if phase == kind else (False, f"Not{kind}", "")
    ready_ok = phase in ("Running", "Succeeded")
    table["Ready"] = (ready_ok, "WorkersRunning" if phase == "Running" else reason, message)
    kinds: tuple[str, ...] = CONDITION_TYPES
    if m.spec.training_data is not None:
        kinds = (*CONDITION_TYPES, DATA_CONDITION)
        table[DATA_CONDITION] = data_condition(m)
    if (admitted := admitted_condition(m, reason, message)) is not None:
        kinds = (*kinds, ADMITTED_CONDITION)
        table[ADMITTED_CONDITION] = admitted
    previous = {c.type: c for c in st.conditions}
    storage = storage_condition(previous.get(STORAGE_CONDITION), m.obs.progress, m.obs.status.checkpoint, st.checkpoint)
    if storage is not None:
        kinds = (*kinds, STORAGE_CONDITION)
        table[STORAGE_CONDITION] = storage
        storage_events(m, previous.get(STORAGE_CONDITION), storage)
    conditions = list(st.conditions)
    for kind in kinds:
        ok, why, text = table[kind]
        status: ConditionStatus = "True" if ok else "False"
        new = Condition(type=kind, status=status, reason=why, message=text, observed_generation=gen)
        conditions = set_condition(conditions, new, now)
        old = previous.get(kind)
        if kind == "Ready" and why in POD_REASONS and (old is None or old.reason != why):
            m.event("Warning", why, text)
    st.conditions = conditions


def storage_events(m: Machine, old: Condition | None, new: tuple[bool, str, str]) -> None:
    """An event when checkpoint storage starts failing and when it takes checkpoints again."""
    ok, _, message = new
    if not ok and (old is None or old.reason != RETRYING):
        m.event("Warning", "CheckpointUploadRetrying", message)
    elif ok and old is not None and old.reason == RETRYING:
        m.event("Normal", "CheckpointUploaded", f"{message}; checkpoint storage answers again")
