"""The local stack's Prometheus configuration: pods found through the API server, annotations honoured."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loom.devstack.prometheus import PROMETHEUS_MODULE, scrape_config


def _rules(config: dict[str, Any]) -> list[dict[str, Any]]:
    return list(config["scrape_configs"][0]["relabel_configs"])


def test_discovers_pods_through_the_kubeconfig_and_keeps_only_annotated_ones() -> None:
    config = scrape_config(kubeconfig=Path("/k/admin.kubeconfig"), scrape_interval_s=1.5, namespaces=["a"])
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [
        {"role": "pod", "kubeconfig_file": "/k/admin.kubeconfig", "namespaces": {"names": ["a"]}}
    ]
    assert config["global"]["scrape_interval"] == "1500ms"
    rules = _rules(config)
    assert rules[0] == {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "regex": "true", "action": "keep"
    }
    # The labels the autoscaler's queries select on.
    targets = {r.get("target_label"): r["source_labels"] for r in rules if "target_label" in r}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]


def test_the_port_annotation_replaces_the_declared_port() -> None:
    rule = next(r for r in _rules(scrape_config(kubeconfig=Path("k"))) if r.get("target_label") == "__address__")
    # Prometheus joins source labels with ';' and anchors the RE2 regex at both ends.
    regex = re.compile(rule["regex"])

    def relabel(address: str, port: str) -> str:
        match = regex.fullmatch(f"{address};{port}")
        return match.expand(rule["replacement"].replace("$", "\\")) if match else address

    assert relabel("127.0.3.4:8080", "9400") == "127.0.3.4:9400"
    assert relabel("127.0.3.4", "9400") == "127.0.3.4:9400"  # a pod that declares no port
    assert relabel("127.0.3.4:8080", "") == "127.0.3.4:8080"  # no annotation: the declared port


def test_built_with_kubernetes_discovery_only() -> None:
    assert PROMETHEUS_MODULE.tags == ("remove_all_sd", "enable_kubernetes_sd")
    go_mod = (PROMETHEUS_MODULE.source_dir / "go.mod").read_text()
    assert "\ntool github.com/prometheus/prometheus/cmd/prometheus\n" in go_mod
