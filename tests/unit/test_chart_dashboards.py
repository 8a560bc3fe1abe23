"""charts/loom/dashboards (Grafana dashboards the chart ships as ConfigMaps) and charts/loom/ci (values files the
e2e dry run renders), without a cluster: every series a dashboard queries is one Loom really exports, under the
name Prometheus gives it (counters with _total, histograms through _bucket/_sum/_count), and the ci values are
valid against values.schema.json. Rendering and the API server's verdict are in e2e/tests/test_chart_dry_run.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "loom"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# Series from exporters Loom documents beside its own: kube-state-metrics (container restarts).
EXTERNAL = {"kube_pod_container_status_restarts_total"}
SERIES = re.compile(r"\b(loom_[a-z_]+|DCGM_FI_[A-Z_]+|kube_[a-z_]+)\b")
DEFINED = re.compile(r"(Counter|Gauge|Histogram|Summary|GaugeMetricFamily|CounterMetricFamily)\(\s*\"(loom_[a-z_]+)\"")


def exported() -> dict[str, str]:
    """Every loom_* metric defined in the operator and the workloads, with its kind."""
    found: dict[str, str] = {}
    for path in [*(REPO / "operator").rglob("*.py"), *(REPO / "workloads").rglob("*.py")]:
        for kind, name in DEFINED.findall(path.read_text()):
            found[name] = kind
    return found


def prometheus_names() -> set[str]:
    """The series names Prometheus stores for what Loom exports (prometheus_client's naming rules)."""
    names: set[str] = set()
    for name, kind in exported().items():
        if kind in {"Counter", "CounterMetricFamily"}:
            names |= {f"{name}_total", f"{name}_created"}
        elif kind in {"Histogram", "Summary"}:
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def gpu_names() -> set[str]:
    text = (REPO / "workloads" / "server" / "metrics.py").read_text()
    return set(re.findall(r"\"(DCGM_FI_[A-Z_]+)\"", text))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_three_dashboards_are_there() -> None:
    assert [p.stem for p in DASHBOARDS] == ["loom-autoscaling", "loom-serving", "loom-training"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_a_dashboard_queries_only_series_loom_exports(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] == path.stem and dashboard["title"].startswith("Loom / ")
    known = prometheus_names() | gpu_names() | EXTERNAL
    exprs = expressions(dashboard)
    assert exprs
    for expr in exprs:
        used = set(SERIES.findall(expr))
        assert used, expr
        assert used <= known, (path.name, used - known)
    # Each panel reads the datasource the dashboard's variable picks (the importer's Prometheus).
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_dashboards_cover_what_the_issue_names() -> None:
    text = {p.stem: " ".join(expressions(json.loads(p.read_text()))) for p in DASHBOARDS}
    for series in ("loom_trainer_step", "loom_trainer_loss", "resets(loom_trainer_step"):
        assert series in text["loom-training"], series
    for series in ("loom_server_request_duration_seconds_bucket", "loom_server_batch_size_bucket",
                   "loom_server_queue_depth", "DCGM_FI_DEV_GPU_UTIL"):  # fmt: skip
        assert series in text["loom-serving"], series
    for series in ("loom_server_model_ready", "loom_server_requests_total", "loom_activator_wakes_total"):
        assert series in text["loom-autoscaling"], series


def test_the_ci_values_are_valid_and_turn_every_option_on() -> None:
    validator = jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in sorted((CHART / "ci").glob("*.yaml")):
        values = yaml.safe_load(path.read_text())
        assert list(validator.iter_errors({**defaults, **values})) == [], path.name
    maximal = yaml.safe_load((CHART / "ci" / "max-values.yaml").read_text())
    # Every top-level value set (the maximal file leaves no option at its default by omission).
    assert set(maximal) == set(defaults)
    assert maximal["dashboards"]["enabled"] and maximal["metrics"]["serviceMonitor"]["enabled"]
    assert maximal["replicas"] > 1 and maximal["webhook"]["enabled"]
    assert set(maximal["workloadImages"]) == set(defaults["workloadImages"])
