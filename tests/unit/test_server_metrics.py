"""GPU metrics under dcgm-exporter's names, read through an NVML stand-in (real NVML needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from loom.workloads.server.metrics import NvmlCollector, ServerMetrics


class FakeNvml:
    """The slice of the pynvml API the collector calls, for two GPUs."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=40 + handle, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        mib = 1024 * 1024
        return SimpleNamespace(used=1000 * mib, free=80000 * mib, total=81000 * mib)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("not supported")
        return 250_000

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 55


def test_gpu_metrics_use_dcgm_exporter_names_and_labels() -> None:
    registry = CollectorRegistry()
    registry.register(NvmlCollector(FakeNvml()))
    text = generate_latest(registry).decode()
    assert "# TYPE DCGM_FI_DEV_GPU_UTIL gauge" in text
    samples = {(s.name, s.labels["gpu"]): s for family in registry.collect() for s in family.samples}
    first = samples[("DCGM_FI_DEV_GPU_UTIL", "0")]
    assert first.value == 40.0
    assert {k: v for k, v in first.labels.items() if k != "Hostname"} == {
        "gpu": "0", "UUID": "GPU-0", "device": "nvidia0", "modelName": "NVIDIA H100 80GB HBM3",
    }
    assert samples[("DCGM_FI_DEV_GPU_UTIL", "1")].value == 41.0
    assert samples[("DCGM_FI_DEV_FB_USED", "0")].value == 1000.0
    assert samples[("DCGM_FI_DEV_FB_FREE", "1")].value == 80000.0
    assert samples[("DCGM_FI_DEV_POWER_USAGE", "0")].value == 250.0
    # A board that cannot report power simply has no power sample; its other metrics remain.
    assert ("DCGM_FI_DEV_POWER_USAGE", "1") not in samples


def test_without_nvml_there_are_no_gpu_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    # Absent series, not zeros that would look like an idle GPU.
    assert NvmlCollector.create() is None
    metrics = ServerMetrics("m")
    assert "DCGM_" not in generate_latest(metrics.registry).decode()


def test_server_metrics_register_the_gpu_collector_when_given_one() -> None:
    metrics = ServerMetrics("m", gpu=NvmlCollector(FakeNvml()))
    assert "DCGM_FI_DEV_FB_USED" in generate_latest(metrics.registry).decode()
