"""A Kubernetes controller with a webhook server, run as a host process of the local stack (Kueue: kueue.py,
LeaderWorkerSet: lws.py): what the two have in common, described once by a `HostWebhookController`.

- Its objects come from the Helm chart in its Go module (copied out of the read-only module cache once, rendered
  by the stack's helm); each controller's `adapt` keeps and adapts what a host process needs (its Deployment and
  RBAC are left out: the binary runs on the host, as admin). The webhook Service loses its selector: the webhook
  server is on the host, and the stack's egress proxy maps the Service's ClusterIP:443 to the host port through
  `host-services.json` (egress.py).
- Its configuration binds 127.0.0.1 on free ports (several stacks share a machine), no leader election, no
  metrics server, and the controller's internal certificate management on, whose rotator writes a CA and a
  serving certificate into a Secret; the stack copies them where the webhook server reads them, as the kubelet
  would for a mounted Secret (webhook_certs.py).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster.gomod import copy_tree_out, module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.paths import STACK_DIR, cache_root
from loom.devstack.cluster.webhook_certs import sync_from_secret

Progress = Callable[[str], None]
Doc = dict[str, Any]


@dataclass(frozen=True)
class HostWebhookController:
    name: str  # short and lower case: the release's, the state folder's and the progress lines' name
    go_module: str
    version: str
    chart_path: str  # the chart's folder inside the Go module
    namespace: str
    webhook_service: str
    cert_secret: str
    crd_names: tuple[str, ...]  # full names, waited for until established
    config_api_version: str
    # A chart object (not the webhook Service) -> what the host-run controller needs of it, or None to leave it out.
    adapt: Callable[[Doc], Doc | None]
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # the controller's own configuration fields
    helm_args: tuple[str, ...] = ()

    @property
    def state_dir(self) -> Path:
        return STACK_DIR / self.name

    @property
    def config_file(self) -> Path:
        return self.state_dir / "config.yaml"

    @property
    def cert_dir(self) -> Path:
        return self.state_dir / "certs"

    def chart_dir(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}" / "chart"

    def fetch_chart(self, progress: Progress = print) -> Path:
        """Copy the chart out of the Go module (the module build.py compiles; in Go's module cache) once."""
        if (self.chart_dir() / "Chart.yaml").is_file():
            return self.chart_dir()
        final = copy_tree_out(module_dir(self.go_module, self.version) / self.chart_path, self.chart_dir())
        progress(f"{self.name}: chart of {self.go_module} {self.version} -> {final}")
        return final

    def configuration(self, webhook_port: int, health_port: int, cert_dir: Path | None = None) -> Doc:
        """The controller's Configuration for the host process."""
        return {
            "apiVersion": self.config_api_version,
            "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here, and it would need a port per stack
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir or self.cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {
                "enable": True,
                "webhookServiceName": self.webhook_service,
                "webhookSecretName": self.cert_secret,
            },
            **self.extra_config,
        }

    def select(self, rendered: list[Doc]) -> list[Doc]:
        """Of the chart's objects, what the host-run controller needs, adapted: its namespace first."""
        out: list[Doc] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}}]
        for doc in rendered:
            if doc.get("kind") == "Service" and (doc.get("metadata") or {}).get("name") == self.webhook_service:
                spec = {k: v for k, v in doc["spec"].items() if k != "selector"}  # served from the host
                out.append({**doc, "spec": spec})
            elif (kept := self.adapt(doc)) is not None:
                out.append(kept)
        return out

    def render(self, cluster: Cluster) -> list[Doc]:
        argv = [str(cluster.bin_dir / "helm"), "template", self.name, str(self.fetch_chart()),
                "--namespace", self.namespace, *self.helm_args]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, env=cluster.env, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"helm template of {self.name}'s chart failed: {result.stderr}")
        return [d for d in yaml.safe_load_all(result.stdout) if d]

    def install(self, cluster: Cluster, progress: Progress = print) -> str:
        """Apply the controller's objects (idempotent); return the webhook Service's ClusterIP."""
        objects = self.select(self.render(cluster))
        cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", "-",
            stdin=yaml.safe_dump_all(objects),
        )  # fmt: skip
        cluster.wait_crds_established(list(self.crd_names), timeout_s=60)
        ip = cluster.kubectl(
            "get", "service", "-n", self.namespace, self.webhook_service, "-o", "jsonpath={.spec.clusterIP}"
        )
        progress(f"{self.name}: {len(objects)} objects of its chart applied")
        return ip.stdout.strip()

    def host_services(self, cluster_ip: str, webhook_port: int) -> dict[str, Any]:
        """The egress proxy's entry for the webhook Service: its ClusterIP:443 -> the host process's port."""
        return {
            f"{self.namespace}/{self.webhook_service}": {
                "clusterIP": cluster_ip,
                "ports": [443],
                "address": "127.0.0.1",
                "targetPorts": {"443": webhook_port},
            }
        }

    def write_config(self, webhook_port: int, health_port: int) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(yaml.safe_dump(self.configuration(webhook_port, health_port)))

    def sync_certificates(self, cluster: Cluster, timeout_s: float = 90) -> None:
        """What a Secret volume would do: put the Secret's keys, once the rotator wrote them, in the cert dir."""
        sync_from_secret(cluster, self.namespace, self.cert_secret, self.cert_dir, timeout_s)
