"""When a wait is over (pure): the object reached what was asked, or can no longer reach it.

A wait fails with the object's own words: the message of the condition that says what went wrong (Ready=False,
or another False condition), never a bare timeout when the object already explained itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Phases an object does not leave by itself. A TrainingJob that succeeded never runs again; a Failed object of any
# kind needs a change to its spec.
TERMINAL_PHASES = {"TrainingJob": ("Succeeded", "Failed")}
FAILED = "Failed"


@dataclass(frozen=True)
class Target:
    """What to wait for: a condition with a status (Ready=True by default), or a phase."""

    condition: str | None = "Ready"
    status: str = "True"
    phase: str | None = None

    def __post_init__(self) -> None:
        if (self.condition is None) == (self.phase is None):
            raise ValueError("wait for exactly one of a condition or a phase")

    def describe(self) -> str:
        return f"phase {self.phase}" if self.phase else f"condition {self.condition}={self.status}"


@dataclass(frozen=True)
class Verdict:
    done: bool
    # Why the target can no longer be reached (the object's own message), or None.
    failure: str | None = None
    # One line about where the object stands, for a timeout's message.
    summary: str = ""


def conditions(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (manifest.get("status") or {}).get("conditions") or []}


def explain(manifest: dict[str, Any]) -> str:
    """The object's own account of what is wrong: Ready's message when Ready is not True, else the first False
    condition's, each with its reason; empty when no condition says anything."""
    found = conditions(manifest)
    ordered = ([found["Ready"]] if "Ready" in found else []) + [c for t, c in found.items() if t != "Ready"]
    for cond in ordered:
        if cond.get("status") != "True" and (cond.get("message") or cond.get("reason")):
            reason = cond.get("reason") or ""
            message = cond.get("message") or ""
            return f"{cond.get('type')}={cond.get('status')} {reason}: {message}".strip().rstrip(":")
    return ""


def summary(manifest: dict[str, Any]) -> str:
    status = manifest.get("status") or {}
    said = explain(manifest)
    phase = status.get("phase") or "no phase yet"
    return f"phase {phase}" + (f"; {said}" if said else "")


def judge(manifest: dict[str, Any], target: Target) -> Verdict:
    """Whether waiting for `target` on this object is over."""
    status = manifest.get("status") or {}
    phase = status.get("phase")
    kind = str(manifest.get("kind") or "")
    name = (manifest.get("metadata") or {}).get("name", "")
    here = summary(manifest)
    if target.phase is not None:
        if phase == target.phase:
            return Verdict(True, summary=here)
    else:
        cond = conditions(manifest).get(target.condition or "")
        generation = (manifest.get("metadata") or {}).get("generation")
        observed = cond.get("observedGeneration") if cond else None
        # A condition computed from an older spec says nothing about this one.
        current = observed is None or generation is None or observed >= generation
        if cond and current and cond.get("status") == target.status:
            return Verdict(True, summary=here)
    terminal = TERMINAL_PHASES.get(kind, (FAILED,))
    if phase in terminal and phase != target.phase:
        said = explain(manifest) or "no condition says why"
        return Verdict(False, f"{kind} {name} is {phase} ({said}) and cannot reach {target.describe()}", here)
    return Verdict(False, summary=here)
