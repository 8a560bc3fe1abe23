"""Placeholder for kinds whose controller has not landed: Ready=Unknown, reason NotImplemented."""

from __future__ import annotations

from typing import Any

import kopf

from ..api import GROUP, VERSION, Kind
from ..api.common import Condition, set_condition


def not_implemented_status(kind: str, generation: int | None, status: dict[str, Any]) -> dict[str, Any]:
    """Status patch saying honestly that nothing reconciles this kind yet (pure)."""
    current = [Condition.model_validate(c) for c in status.get("conditions", [])]
    ready = Condition(
        type="Ready",
        status="Unknown",
        reason="NotImplemented",
        message=f"this Loom version does not reconcile {kind} yet",
        observed_generation=generation,
    )
    conditions = set_condition(current, ready)
    return {
        "observedGeneration": generation,
        "conditions": [c.to_wire() for c in conditions],
    }


def register(kind: Kind) -> None:
    @kopf.on.resume(GROUP, VERSION, kind.plural)
    @kopf.on.create(GROUP, VERSION, kind.plural)
    @kopf.on.update(GROUP, VERSION, kind.plural, field="spec")
    def _placeholder(meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
        patch.status.update(not_implemented_status(kind.kind, meta.get("generation"), dict(status)))
