"""TrainingJob fields that cannot change once the job has started.

The controller applies a changed spec to the children it re-renders (the trainer ConfigMap, the rendezvous
Service) but never restarts running workers for it: a worker replaced after a failure would be rendered from the
new spec and join a gang started from the old one. A different image, entrypoint, engine options, world size,
GPU count or checkpoint location in one gang is a broken run (mismatched code, shapes, or checkpoints), so those
fields are frozen from the moment the operator created the first worker (phase Created) until the end, and a
finished job keeps the spec it ran with. Before that (no phase yet, or Pending) everything may change.

What stays mutable while running is what the controller acts on safely or what only affects placement:
`runPolicy` (suspend, backoffLimit, deadlines, TTL), `maxSteps`, `scheduling`, `successPolicy`, and the workers'
resources, nodeSelector and tolerations. `engine` is immutable always (a CEL rule on the CRD). To change a frozen
field, create a new TrainingJob; it can resume from this one's checkpoint (`checkpoint.resume: s3://...`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import Violation

# Phases from which the job has (or had) workers running.
STARTED_PHASES = frozenset({"Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed"})
# Paths under spec, as the wire names them.
FROZEN_ONCE_STARTED: tuple[tuple[str, ...], ...] = (
    ("image",),
    ("entrypoint",),
    ("env",),
    ("workers", "replicas"),
    ("workers", "minReplicas"),
    ("workers", "maxReplicas"),
    ("workers", "gpusPerWorker"),
    ("deepspeed",),
    ("fsdp",),
    ("checkpoint", "uri"),
    ("tracking",),
    # The checkpoints hold this adapter (rank, targets) trained on this base.
    ("finetune",),
)
_MISSING = object()


def _at(spec: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = spec
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return _MISSING
        value = value[key]
    return value


def started(old: Mapping[str, Any]) -> str | None:
    """The phase of a started job (the stored object, before the update), else None."""
    phase = (old.get("status") or {}).get("phase")
    return phase if phase in STARTED_PHASES else None


def trainingjob_update_violations(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Violation]:
    """Frozen fields this update changes, if the job has started."""
    phase = started(old)
    if phase is None:
        return []
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    return [
        Violation(
            "spec." + ".".join(path),
            f"cannot change once the job has started (phase {phase}): workers started from the old value would "
            "run beside workers from the new one; create a new TrainingJob (it can resume from this one's "
            "checkpoint with checkpoint.resume)",
        )
        for path in FROZEN_ONCE_STARTED
        if _at(old_spec, path) != _at(new_spec, path)
    ]
