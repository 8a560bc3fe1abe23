"""A real Prometheus for the local stack, finding pods through the API server (Kubernetes service discovery).

The binary is built from Prometheus' own Go module (devstack/cluster/go/prometheus) with only the
Kubernetes discovery compiled in (`-tags remove_all_sd,enable_kubernetes_sd`). Debian's `prometheus`
package cannot stand in: it is built without Kubernetes discovery (`promtool check config` rejects
kubernetes_sd_configs: "field kubernetes_sd_configs not found in type config.ScrapeConfig").

Scraping follows the common `prometheus.io/*` pod annotations, as the community Helm chart does:
  prometheus.io/scrape: "true"   scrape this pod
  prometheus.io/port: "9090"     on this port (default: each declared container port)
  prometheus.io/path: /metrics   at this path (default /metrics)
  prometheus.io/scheme: http     or https
Every series gets the pod's `namespace` and `pod` labels, the ones the autoscaler's queries select on
(loom.operator.autoscale.promql). Pods of the node agent listen on their own 127.x address, which
this host reaches directly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.agent.shim import published_host_port
from loom.devstack.cluster.build import MODULES, Progress, build, stack_bin_dir
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.servers import ServiceStartError, free_port

# Built with the rest of the stack (`loom dev build`); see MODULES in devstack/cluster/build.py.
PROMETHEUS_MODULE = next(m for m in MODULES if m.name == "prometheus")
DEFAULT_SCRAPE_INTERVAL_S = 2.0
_DEFAULT_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PrometheusEndpoint:
    url: str  # http://127.0.0.1:<port>
    scrape_interval_s: float
    config_file: Path
    log_file: Path


def scrape_config(
    *, kubeconfig: Path, scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S, namespaces: list[str] | None = None
) -> dict[str, Any]:
    """prometheus.yml: discover pods through the API server named in `kubeconfig`, scrape annotated ones."""
    interval = f"{int(scrape_interval_s * 1000)}ms"
    discovery: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    if namespaces:
        discovery["namespaces"] = {"names": list(namespaces)}
    annotation = "__meta_kubernetes_pod_annotation_prometheus_io_"
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                # Prometheus 3 refuses a scrape whose Content-Type is missing or unknown; plain text is
                # what a hand-written exporter serves.
                "fallback_scrape_protocol": "PrometheusText0.0.4",
                "kubernetes_sd_configs": [discovery],
                "relabel_configs": [
                    {"source_labels": [f"{annotation}scrape"], "regex": "true", "action": "keep"},
                    # Finished pods have no server any more; pods without an address cannot be scraped.
                    {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Succeeded|Failed", "action": "drop"},
                    {"source_labels": ["__meta_kubernetes_pod_ip"], "regex": "", "action": "drop"},
                    {"source_labels": [f"{annotation}scheme"], "regex": "(https?)", "target_label": "__scheme__"},
                    {"source_labels": [f"{annotation}path"], "regex": "(.+)", "target_label": "__metrics_path__"},
                    {
                        # One target per declared port, all moved to the annotated port: Prometheus then
                        # keeps one, as their labels are equal.
                        "source_labels": ["__address__", f"{annotation}port"],
                        "regex": r"([^:]+)(?::\d+)?;(\d+)",
                        "replacement": "$1:$2",
                        "target_label": "__address__",
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"},
                ],
            }
        ],
    }


def prometheus_binary() -> Path:
    """The built binary; a clear error when the stack was built without it."""
    binary = stack_bin_dir() / "prometheus"
    if not binary.is_file():
        raise ServiceStartError(
            "Prometheus is not built: run `loom dev build` (or `make stack`), which builds it from "
            f"{PROMETHEUS_MODULE.source_dir}"
        )
    return binary


def ensure_built(progress: Progress = print) -> Path:
    """The binary, building the stack first if any of it (Prometheus included) is missing; a no-op once built."""
    build(progress)
    return prometheus_binary()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def prometheus_server(
    data_dir: Path,
    *,
    kubeconfig: Path,
    binary: Path | None = None,
    port: int | None = None,
    scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
    namespaces: list[str] | None = None,
    start_timeout_s: float = _DEFAULT_START_TIMEOUT_S,
) -> Iterator[PrometheusEndpoint]:
    """Run Prometheus on a loopback port until the block ends; its TSDB and log live under data_dir."""
    binary = binary or prometheus_binary()
    data_dir.mkdir(parents=True, exist_ok=True)
    config_file = data_dir / "prometheus.yml"
    config_file.write_text(
        yaml.safe_dump(scrape_config(kubeconfig=kubeconfig, scrape_interval_s=scrape_interval_s, namespaces=namespaces))
    )
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = data_dir / "prometheus.log"
    command = [
        str(binary),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data_dir / 'tsdb'}",
        "--storage.tsdb.retention.time=1d",
        f"--web.listen-address=127.0.0.1:{port}",
        # POST /-/reload after rewriting the config, instead of a restart.
        "--web.enable-lifecycle",
    ]
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _ready(url):
            if proc.poll() is not None:
                raise ServiceStartError(f"prometheus exited with {proc.returncode}; see {log_file}")
            if time.monotonic() > deadline:
                raise ServiceStartError(f"prometheus not ready after {start_timeout_s:g}s; see {log_file}")
            time.sleep(0.2)
        # Pods on the node agent may be given this address: publish the port to them (agent/shim.py).
        with published_host_port(AGENT_STATE_DIR, port):
            yield PrometheusEndpoint(
                url=url, scrape_interval_s=scrape_interval_s, config_file=config_file, log_file=log_file
            )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)  # it flushes the TSDB head on SIGTERM
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
