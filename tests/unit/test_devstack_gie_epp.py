"""GIE's reference endpoint picker beside host-process replicas (devstack/gie_epp.py): the pure parts (addresses,
the pool and its pods, the EPP's command line) and the Go module it is built from. The EPP itself runs only in
bench/bench_prefix_routing.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loom.devstack.cluster import gie
from loom.devstack.cluster.build import BENCH_MODULES, build_bench_binary
from loom.devstack.cluster.paths import GO_MODULES_DIR
from loom.devstack.gie_epp import (
    DEFAULT_PLUGINS,
    EppPorts,
    epp_argv,
    pod_manifest,
    pool_manifest,
    replica_address,
    target_port,
)


def test_each_replica_has_its_own_loopback_address() -> None:
    assert [replica_address(i) for i in range(3)] == ["127.0.0.10", "127.0.0.11", "127.0.0.12"]
    with pytest.raises(ValueError, match="out of range"):
        replica_address(246)


def test_the_replicas_share_one_port_the_pools_target_port() -> None:
    assert target_port(["127.0.0.10:8123", "127.0.0.11:8123"]) == 8123
    with pytest.raises(ValueError, match=r"one port.*\[8123, 8124\]"):
        target_port(["127.0.0.10:8123", "127.0.0.11:8124"])


def test_the_pool_selects_every_replica_pod_on_its_port() -> None:
    labels = {"app": "llm", "loom.dev/bench": "gie-epp"}
    pool = pool_manifest("llm", "ns", labels, 8123)
    pods = [pod_manifest(f"llm-{i}", "ns", labels, 8123) for i in range(3)]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert all(selector.items() <= pod["metadata"]["labels"].items() for pod in pods)
    assert pool["spec"]["targetPorts"] == [{"number": 8123}]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    # The pods go to kwok's nodes (nothing runs in them): its node selector and toleration.
    assert all(pod["spec"]["nodeSelector"] == {"type": "kwok"} for pod in pods)
    # The callers' label dicts are not shared with the manifests.
    pool["spec"]["selector"]["matchLabels"]["x"] = "y"
    assert "x" not in labels


def test_the_epp_runs_the_charts_plugins_in_plain_grpc_with_vllm_v1_metric_names(tmp_path: Path) -> None:
    argv = epp_argv(Path("/bin/epp"), "llm", "ns", EppPorts(grpc=1, health=2, metrics=3), tmp_path / "p.yaml")
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv[1:])
    assert len(flags) == len(argv) - 1  # no flag twice
    assert flags["pool-name"] == "llm" and flags["pool-namespace"] == "ns"
    assert (flags["grpc-port"], flags["grpc-health-port"], flags["metrics-port"]) == ("1", "2", "3")
    assert flags["config-file"] == str(tmp_path / "p.yaml")
    assert flags["secure-serving"] == "false"  # the Envoy here speaks h2c to every picker
    # vLLM 0.32 exports vllm:kv_cache_usage_perc (the name Loom's picker reads too), not v1.1's default name.
    assert flags["kv-cache-usage-percentage-metric"] == "vllm:kv_cache_usage_perc"
    assert flags["lora-info-metric"] == ""


def test_the_default_plugins_are_the_three_scorers_of_one_profile() -> None:
    config = yaml.safe_load(DEFAULT_PLUGINS)
    assert config["kind"] == "EndpointPickerConfig"
    types = [p["type"] for p in config["plugins"]]
    assert types == ["queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"]
    [profile] = config["schedulingProfiles"]
    assert [p["pluginRef"] for p in profile["plugins"]] == types


def test_the_epp_is_built_at_the_version_whose_crds_the_stack_installs() -> None:
    assert "gie-epp" in {m.name for m in BENCH_MODULES}
    go_mod = (GO_MODULES_DIR / "gie-epp" / "go.mod").read_text()
    assert f"\n\t{gie.GIE_MODULE} {gie.GIE_VERSION} // indirect\n" in go_mod
    assert f"\ntool {gie.GIE_MODULE}/cmd/epp\n" in go_mod


def test_a_bench_binary_no_module_builds_is_refused() -> None:
    with pytest.raises(ValueError, match="no bench module builds 'nope'"):
        build_bench_binary("nope")
