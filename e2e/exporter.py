"""A test-driven metrics exporter pod for e2e tests: the test sets the exposition text it serves, Prometheus
scrapes it through Kubernetes service discovery (prometheus.io/* annotations), so every metric a test reads took
the real path. `dcgm_series` writes GPU series the way dcgm-exporter does (pod/namespace labels for other pods;
Prometheus renames them exported_pod/exported_namespace because the target has its own pod/namespace).

Also the module-scoped Prometheus the autoscaling tests share the shape of (`local_prometheus`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.prometheus import PrometheusEndpoint, ensure_built, prometheus_server

PORT = 9400

# GET <PATH> answers the text last set; POST /set replaces it (204). No Content-Type unless CONTENT_TYPE is set,
# as hand-written exporters often do (the stack's Prometheus falls back to the text format).
SERVER = """
import http.server, os, threading
path, ctype, lock = os.environ["METRICS_PATH"], os.environ.get("CONTENT_TYPE", ""), threading.Lock()
state = {"body": os.environ.get("INITIAL", "").encode()}
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        text = self.rfile.read(int(self.headers["Content-Length"]))
        with lock:
            state["body"] = text
        self.send_response(204); self.end_headers()
    def do_GET(self):
        if self.path != path:
            self.send_response(404); self.end_headers(); return
        with lock:
            body = state["body"]
        self.send_response(200)
        if ctype:
            self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("", int(os.environ["PORT"])), Handler).serve_forever()
"""


def dcgm_series(namespace: str, utilisation: Mapping[str, float]) -> str:
    """DCGM_FI_DEV_GPU_UTIL per pod, one GPU each, as dcgm-exporter labels it."""
    lines = [
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="GPU-{i}",pod="{pod}",namespace="{namespace}"}} {value}'
        for i, (pod, value) in enumerate(sorted(utilisation.items()))
    ]
    return "".join(f"{line}\n" for line in lines)


def exporter_pod(
    name: str,
    *,
    path: str = "/metrics",
    initial: str = "",
    content_type: str = "",
    extra_ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "exporter",
        "image": "python:3.11-slim",
        "command": ["python", "-c", SERVER],
        "env": [
            {"name": "PORT", "value": str(PORT)},
            {"name": "METRICS_PATH", "value": path},
            {"name": "INITIAL", "value": initial},
            {"name": "CONTENT_TYPE", "value": content_type},
        ],
    }
    if extra_ports:
        container["ports"] = extra_ports
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(PORT),
                "prometheus.io/path": path,
            },
        },
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        },
    }


class Exporter:
    """One exporter pod in `namespace`; `start` applies it and waits until it is Ready."""

    def __init__(self, cluster: Cluster, namespace: str, name: str = "dcgm-exporter", **pod: Any) -> None:
        self.cluster, self.namespace, self.name, self.pod = cluster, namespace, name, pod
        self.url = ""

    def start(self) -> None:
        ns, kubectl = self.namespace, self.cluster.kubectl
        kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(exporter_pod(self.name, **self.pod)))
        kubectl("wait", "-n", ns, "--for=condition=Ready", f"pod/{self.name}", "--timeout=120s")
        pod = json.loads(kubectl("get", "pod", self.name, "-n", ns, "-o", "json").stdout)
        self.url = f"http://{pod['status']['podIP']}:{PORT}"

    def publish_text(self, text: str) -> float:
        """Serve `text` from now on; returns when it was set (Unix time)."""
        wait_until(lambda: self._post(text), timeout=30, what="the exporter answering", interval=0.5)
        return time.time()

    def publish(self, utilisation: Mapping[str, float]) -> float:
        """GPU utilisation per pod (dcgm-exporter series); returns when it was set (Unix time)."""
        return self.publish_text(dcgm_series(self.namespace, utilisation))

    def _post(self, text: str) -> bool:
        try:
            return httpx.post(f"{self.url}/set", content=text.encode(), timeout=5, trust_env=False).status_code == 204
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.cluster.kubectl("delete", "pod", self.name, "-n", self.namespace, "--wait=true")


@contextlib.contextmanager
def local_prometheus(cluster: Cluster, data_dir: Path, scrape_interval_s: float = 1.0) -> Iterator[PrometheusEndpoint]:
    """The stack's Prometheus (built if needed), scraping every `scrape_interval_s`, for the block."""
    ensure_built()
    with prometheus_server(data_dir, kubeconfig=cluster.kubeconfig, scrape_interval_s=scrape_interval_s) as endpoint:
        yield endpoint
