"""Prometheus metrics of the model server, and GPU metrics read through NVML.

GPU metrics carry dcgm-exporter's names and labels (DCGM_FI_DEV_GPU_UTIL, DCGM_FI_DEV_FB_USED, ...)
so the autoscaling rules written for dcgm-exporter work unchanged on clusters without it. Without
a GPU (or without NVML) they are absent rather than zero: a zero would look like an idle GPU.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class RequestMetrics:
    """The request metrics of every Loom endpoint that looks like a model (the model server, the graph router):
    one set of names, with the model (or graph) as the ``model`` label, so dashboards and autoscaling rules
    written for one read the other unchanged."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        self.registry = registry
        self.model = model_name
        self.request_latency = Histogram(
            "loom_server_request_duration_seconds",
            "Time from receiving a request to sending its response.",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "loom_server_requests", "Requests answered, by endpoint and HTTP status code.",
            ["model", "endpoint", "code"], registry=self.registry,
        )
        self.errors = Counter(
            "loom_server_request_errors", "Requests answered with an error, by HTTP status code.",
            ["model", "code"], registry=self.registry,
        )
        self.inflight = Gauge(
            "loom_server_inflight_requests", "Requests being handled now (queued, running or streaming).",
            ["model"], registry=self.registry,
        )

    def answered(self, endpoint: str, code: int, seconds: float) -> None:
        self.request_latency.labels(self.model, endpoint).observe(seconds)
        self.requests.labels(self.model, endpoint, str(code)).inc()
        if code >= 400:
            self.errors.labels(self.model, str(code)).inc()


class ServerMetrics(RequestMetrics):
    """All server metrics, in their own registry (one per app, so tests can build many apps)."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, gpu: NvmlCollector | None = None
    ):
        super().__init__(model_name, registry or CollectorRegistry())
        if gpu is not None:
            self.registry.register(gpu)
        self.batch_size = Histogram(
            "loom_server_batch_size", "Requests per predict call.", ["model"],
            buckets=_BATCH_BUCKETS, registry=self.registry,
        )
        self.batch_latency = Histogram(
            "loom_server_batch_duration_seconds", "Time one predict call took.", ["model"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue = Gauge(
            "loom_server_queue_depth", "Requests waiting to join a batch.", ["model"], registry=self.registry
        )
        self.ready = Gauge(
            "loom_server_model_ready", "1 once the model is loaded and serving.", ["model"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "loom_server_generated_tokens", "Tokens produced by generate endpoints.", ["model"],
            registry=self.registry,
        )

    # BatchObserver
    def batch_done(self, size: int, seconds: float) -> None:
        self.batch_size.labels(self.model).observe(size)
        self.batch_latency.labels(self.model).observe(seconds)

    def queue_depth(self, depth: int) -> None:
        self.queue.labels(self.model).set(depth)


class NvmlCollector(Collector):
    """Reads every GPU through NVML at scrape time and reports it under dcgm-exporter's names."""

    # name, help, reader(handle) -> value
    _FIELDS: tuple[tuple[str, str, str], ...] = (
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gpu_util"),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "mem_util"),
        ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "fb_used"),
        ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "fb_free"),
        ("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", "fb_total"),
        ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power"),
        ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp"),
    )

    def __init__(self, nvml: Any):
        self._nvml = nvml
        self._hostname = socket.gethostname()

    @classmethod
    def create(cls) -> NvmlCollector | None:
        """A collector when NVML finds at least one GPU, else None."""
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                pynvml.nvmlShutdown()
                return None
        except Exception as exc:  # no driver, no library, no device: all mean "no GPU metrics"
            log.info("NVML unavailable, GPU metrics disabled: %s", exc)
            return None
        return cls(pynvml)

    def _read(self, handle: Any) -> dict[str, float]:
        nvml = self._nvml
        values: dict[str, float] = {}
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        values["gpu_util"] = float(util.gpu)
        values["mem_util"] = float(util.memory)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        mib = 1024 * 1024
        values["fb_used"] = memory.used / mib
        values["fb_free"] = memory.free / mib
        values["fb_total"] = memory.total / mib
        try:
            values["power"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            values["temp"] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        except nvml.NVMLError:  # not every board reports power/temperature (e.g. MIG slices)
            pass
        return values

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
        families = {key: GaugeMetricFamily(name, doc, labels=labels) for name, doc, key in self._FIELDS}
        nvml = self._nvml
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                model = nvml.nvmlDeviceGetName(handle)
                label_values = [
                    str(index), _text(uuid), f"nvidia{index}", _text(model), self._hostname,
                ]
                for key, value in self._read(handle).items():
                    families[key].add_metric(label_values, value)
        except nvml.NVMLError as exc:
            log.warning("NVML read failed: %s", exc)
            return
        for family in families.values():
            if family.samples:
                yield family


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
