"""The chaos report's registry (loom.e2e.chaos.registry): figures printed as counts, p50/p99 and failures; one
scenario's crash is its failure and the others still run."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from loom.e2e.chaos import registry
from loom.e2e.chaos.registry import Run, format_figures, percentile, run_scenarios, scenario


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_figures_are_printed_in_order_with_latencies_and_failures() -> None:
    lines = format_figures({"objects": 100, "latency_ms": [1.0, 2.0, 3.0, 4.0], "problems": ["a", "b"]})
    assert lines == [
        "  objects: 100",
        "  latency_ms: n=4 p50=2.0 ms p99=4.0 ms",
        "  failures: 2",
        "    - a",
        "    - b",
    ]


def test_run_counts_failures_and_survives_a_crashing_scenario(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(registry, "SCENARIOS", {})
    monkeypatch.setattr(registry, "SCENARIO_MODULES", ())

    @scenario("fine", "works")
    def fine(run: Run) -> dict[str, object]:
        return {"scale": run.scale, "problems": []}

    @scenario("broken", "raises")
    def broken(run: Run) -> dict[str, object]:
        raise RuntimeError("boom")

    @scenario("unhappy", "reports two failures")
    def unhappy(run: Run) -> dict[str, object]:
        return {"problems": ["x", "y"]}

    out = io.StringIO()
    failures = run_scenarios([], Run(cluster=None, workdir=tmp_path, scale="test"), out)
    assert failures == 3
    text = out.getvalue()
    assert "== fine: works\n  scale: test\n  failures: 0" in text
    assert "scenario crashed: RuntimeError: boom" in text
    with pytest.raises(KeyError, match="unknown scenarios"):
        run_scenarios(["nope"], Run(cluster=None, workdir=tmp_path), out)
