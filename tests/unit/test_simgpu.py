"""The local stack's simulated GPU node and dcgm-exporter stand-in (loom.devstack.simgpu): pure parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from loom.devstack import simgpu
from loom.devstack.cli import dev


def pod(
    name: str, *, gpus: int = 1, service: str = "svc", phase: str = "Running", created: str = "t1"
) -> dict[str, Any]:
    limits = {simgpu.GPU_RESOURCE: str(gpus)} if gpus else {}
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "creationTimestamp": created,
            "labels": {simgpu.SERVICE_LABEL: service} if service else {},
        },
        "spec": {"containers": [{"name": "server", "resources": {"limits": limits}}]},
        "status": {"phase": phase},
    }


def test_the_node_is_shaped_like_a_gpu_node_and_labelled_as_simulated() -> None:
    node = simgpu.node_manifest()
    labels = node["metadata"]["labels"]
    assert labels["type"] == "kwok"  # kwok manages it
    assert labels["nvidia.com/gpu.present"] == "true" and labels[simgpu.SIMULATED_LABEL] == "true"
    # The GPU taint, not kwok's: exactly what the GPU examples tolerate.
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(simgpu.SIM_GPUS)


def test_the_exporter_is_scraped_and_its_settings_are_never_overwritten_by_up() -> None:
    _, settings, deployment = simgpu.exporter_manifests(Path("/k"))
    assert "data" not in settings  # server-side apply then keeps what `loom dev gpu-utilization` wrote
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(simgpu.EXPORTER_PORT)
    assert "--kubeconfig" in template["spec"]["containers"][0]["args"]


def test_series_carry_the_holding_pod_and_its_services_setting() -> None:
    pods = simgpu.gpu_pods([pod("b", created="t2"), pod("a", created="t1", gpus=2), pod("cpu", gpus=0)])
    assert [(p.name, p.gpus) for p in pods] == [("a", 2), ("b", 1)]
    text = simgpu.dcgm_text("n0", 4, pods, {"ns.svc": "90"})
    series = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(series) == 4  # one per GPU of the node
    assert series[0].startswith('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-simulated-n0-0"')
    assert 'namespace="ns",pod="a"' in series[0] and series[0].endswith(" 90")
    assert 'gpu="1"' in series[1] and 'pod="a"' in series[1]
    assert 'gpu="2"' in series[2] and 'pod="b"' in series[2] and series[2].endswith(" 90")
    assert "pod=" not in series[3] and series[3].endswith(" 0")  # a free GPU idles


def test_unset_services_and_finished_or_deleted_pods() -> None:
    gone = pod("gone")
    gone["metadata"]["deletionTimestamp"] = "t9"
    pods = simgpu.gpu_pods([pod("x", service="other"), pod("done", phase="Succeeded"), gone, pod("raw", service="")])
    assert [p.name for p in pods] == ["raw", "x"]  # same creation time: by name
    text = simgpu.dcgm_text("n0", 1, pods, {"ns.svc": "90"})
    series = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(series) == 1 and series[0].endswith(" 0")  # never more series than the node has GPUs


@pytest.mark.parametrize("percent", ["-1", "101", "much"])
def test_the_verb_refuses_a_percent_out_of_range(percent: str) -> None:
    result = CliRunner().invoke(dev, ["gpu-utilization", "-n", "ns", "svc", percent])
    assert result.exit_code == 2 and "PERCENT" in result.output
