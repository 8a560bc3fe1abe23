"""The chaos report's scenario registry: `make chaos` (bench/chaos.py) runs every registered scenario, or the ones
named, at a larger scale than the e2e tests, and prints each one's figures.

A scenario is a function of a `Run` returning `Figures`, registered with `@scenario(name, about)` in a module listed
in `SCENARIO_MODULES` (imported on demand: adding a scenario is one decorated function and one line here):

    @scenario("operator-churn", "mixed objects reconciled while the operator is SIGKILLed every few seconds")
    def operator_churn(run: Run) -> Figures:
        small = run.scale == "test"
        ...
        return {"objects": 100, "problems": [...], "converge_ms": [812.0, ...]}

Figures are a flat dict printed in order: `problems` (a list of strings: the scenario's failures, counted), lists
of numbers under keys ending in `_ms` (printed as n, p50 and p99), anything else as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

Figures = dict[str, Any]
Scale = Literal["test", "report"]

# Modules whose import registers scenarios.
SCENARIO_MODULES = (
    "loom.e2e.chaos.fuzz_scenarios",
    "loom.e2e.chaos.churn",
    "loom.e2e.chaos.storage",
    "loom.e2e.chaos.control_plane",
    "loom.e2e.chaos.serving",
)


@dataclass
class Run:
    """What a scenario gets: the running local stack, a folder for its files, and its scale ("test": the e2e tier's
    small version; "report": the larger one `make chaos` prints)."""

    cluster: Any
    workdir: Path
    scale: Scale = "report"


Scenario = Callable[[Run], Figures]


@dataclass(frozen=True)
class Registered:
    name: str
    about: str
    run: Scenario


SCENARIOS: dict[str, Registered] = {}


def scenario(name: str, about: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = Registered(name, about, fn)
        return fn

    return register


def load() -> dict[str, Registered]:
    for module in SCENARIO_MODULES:
        if importlib.util.find_spec(module) is not None:  # a scenario module still being written is skipped
            importlib.import_module(module)
    return SCENARIOS


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1])


def problems_of(figures: Figures) -> list[str]:
    return [str(p) for p in figures.get("problems") or []]


def format_figures(figures: Figures) -> list[str]:
    lines = []
    for key, value in figures.items():
        if key == "problems":
            continue
        if key.endswith("_ms") and isinstance(value, list):
            numbers = [float(v) for v in value]
            lines.append(
                f"  {key}: n={len(numbers)} p50={percentile(numbers, 50):.1f} ms p99={percentile(numbers, 99):.1f} ms"
            )
        else:
            lines.append(f"  {key}: {value}")
    problems = problems_of(figures)
    lines.append(f"  failures: {len(problems)}")
    lines += [f"    - {p[:400]}" for p in problems[:10]]
    return lines


def run_scenarios(names: list[str], run: Run, out: TextIO = sys.stdout) -> int:
    """Run the named scenarios (all when none), print each one's figures, return the number of failures."""
    registered = load()
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise KeyError(f"unknown scenarios {unknown}; known: {sorted(registered)}")
    failures = 0
    for name in names or list(registered):
        entry = registered[name]
        print(f"== {name}: {entry.about}", file=out, flush=True)
        try:
            figures = entry.run(run)
        except Exception as error:  # one scenario's crash is its failure; the others still run
            figures = {"problems": [f"scenario crashed: {type(error).__name__}: {error}"]}
        for line in format_figures(figures):
            print(line, file=out, flush=True)
        failures += len(problems_of(figures))
    return failures
