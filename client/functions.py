"""TrainingJob.from_function: a Python function as a job's task, for quick experiments.

The function is referenced, not shipped: a job names it as `module:function`, and every worker imports it. So:
- it must be a top-level function (not a lambda, a closure or a method) of a module the workers can import: in the
  cluster, a module installed in the job's image (spec.image); locally, a module on this machine's PYTHONPATH;
- a function defined in a notebook or in the script being run (`__main__`) is refused: the workers could not
  import it;
- it is a TrainTask factory: called with no arguments, it returns a TrainTask (loom.workloads.trainer.task) or a
  TrainTask subclass; the job's `args` reach the task as its `task_args` (JSON values).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from loom.operator.api import Entrypoint, TrainingJob, TrainingJobSpec

from .models import training_job


def entrypoint_of(fn: Callable[..., Any]) -> str:
    """`module:function` for a function the workers can import; ValueError naming the limit it breaks."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or not qualname:
        raise ValueError(f"{fn!r} is not a named function")
    if qualname == "<lambda>" or "<locals>" in qualname or "." in qualname:
        raise ValueError(
            f"{qualname} is not a top-level function of its module: workers import the task as module:function"
        )
    if module == "__main__":
        raise ValueError(
            f"{qualname} is defined in __main__ (a script or a notebook): the workers cannot import it; move it into "
            "a module installed in the job's image (or on PYTHONPATH locally)"
        )
    if getattr(importlib.import_module(module), qualname, None) is not fn:
        raise ValueError(f"{module}:{qualname} does not name this function when imported")
    return f"{module}:{qualname}"


def from_function(
    fn: Callable[..., Any],
    name: str,
    *,
    engine: str = "fsdp",
    args: Mapping[str, Any] | None = None,
    namespace: str | None = None,
    **spec: Any,
) -> TrainingJob:
    """A TrainingJob whose task is `fn` (see the module's limits); other spec fields by keyword, e.g.
    `max_steps=100, workers={"replicas": 2}, checkpoint={...}`."""
    entry = Entrypoint(
        module=entrypoint_of(fn),
        args=[f"{key}={json.dumps(value)}" for key, value in (args or {}).items()],
    )
    return training_job(name, TrainingJobSpec(engine=engine, entrypoint=entry, **spec), namespace=namespace)
