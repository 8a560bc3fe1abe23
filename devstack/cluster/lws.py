"""LeaderWorkerSet in the local stack: its controller manager from its Go module (go/lws), its CRD and webhook
configurations from its own Helm chart, and its own certificate management. Multi-pod InferenceService replicas
(spec.vllm.parallelism.podsPerReplica > 1) render as LeaderWorkerSets.

How it runs here, and why (as Kueue does, kueue.py):
- The binary (`sigs.k8s.io/lws/cmd`, built by build.py) runs on the host with the admin kubeconfig, bound to
  127.0.0.1 on free ports, no leader election, no metrics server. Its namespace is `lws-system`, LWS's default
  outside a pod (it reads the service account's namespace file, which a host process has not).
- Its webhooks are needed, not optional: the pod webhook gives each pod of a group its group index, worker index
  and the group's unique key (labels the controller's pod reconciler and the Services of a group select on), and
  the LeaderWorkerSet webhook applies the API's defaults. `ENABLE_WEBHOOKS=false` would leave groups unlabelled.
  Its pod webhooks select only pods labelled `leaderworkerset.sigs.k8s.io/name`, so no other pod depends on it.
- Its objects come from the chart in the module (`charts/lws`, rendered by the stack's helm with its CRDs): the CRD,
  the webhook configurations and Service, and the empty Secret its rotator fills. Left out: the Deployment (the
  binary runs on the host), RBAC (it runs as admin), the manager's ConfigMap (config.yaml here instead). The CRD's
  conversion webhook is dropped: the CRD has one version (v1), so there is nothing to convert, and LWS's rotator
  injects its CA into the webhook configurations only.
- Certificates: as Kueue's (webhook_certs.py); the API server reaches the webhook Service through the egress proxy,
  whose host-services.json maps its ClusterIP:443 to the host process's port.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster.gomod import copy_tree_out, module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.paths import STACK_DIR, cache_root
from loom.devstack.cluster.webhook_certs import sync_from_secret

LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.8.0"
NAMESPACE = "lws-system"
WEBHOOK_SERVICE = "lws-webhook-service"
CERT_SECRET = "lws-webhook-server-cert"
LWS_DIR = STACK_DIR / "lws"
CONFIG_FILE = LWS_DIR / "config.yaml"
CERT_DIR = LWS_DIR / "certs"
CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
KEPT_KINDS = frozenset({"Secret", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"})

Progress = Callable[[str], None]


def chart_dir() -> Path:
    return cache_root() / f"lws-{LWS_VERSION}" / "chart"


def fetch_chart(progress: Progress = print) -> Path:
    """Copy LWS's Helm chart out of its Go module (the module build.py compiles; in Go's module cache) once."""
    if (chart_dir() / "Chart.yaml").is_file():
        return chart_dir()
    final = copy_tree_out(module_dir(LWS_MODULE, LWS_VERSION) / "charts" / "lws", chart_dir())
    progress(f"lws: chart of {LWS_MODULE} {LWS_VERSION} -> {final}")
    return final


def configuration(webhook_port: int, health_port: int, cert_dir: Path = CERT_DIR) -> dict[str, Any]:
    """LWS's Configuration (config.lws.x-k8s.io/v1alpha1) for the host process."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here, and it would need a port per stack
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": CERT_SECRET,
        },
    }


def _without_conversion(crd: dict[str, Any]) -> dict[str, Any]:
    return {**crd, "spec": {**crd["spec"], "conversion": {"strategy": "None"}}}


def select(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the chart's objects, what the host-run LWS needs, adapted (see the module's docstring)."""
    out: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    for doc in rendered:
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
        if kind == "CustomResourceDefinition":
            out.append(_without_conversion(doc))
        elif kind in KEPT_KINDS:
            out.append(doc)
        elif kind == "Service" and name == WEBHOOK_SERVICE:
            spec = {k: v for k, v in doc["spec"].items() if k != "selector"}  # served from the host
            out.append({**doc, "spec": spec})
    return out


def render(cluster: Cluster) -> list[dict[str, Any]]:
    result = subprocess.run(
        [
            str(cluster.bin_dir / "helm"), "template", "lws", str(fetch_chart()), "--namespace", NAMESPACE,
            "--include-crds",
        ],
        capture_output=True,
        text=True,
        env=cluster.env,
        check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"helm template of LWS's chart failed: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def install(cluster: Cluster, progress: Progress = print) -> str:
    """Apply LWS's objects (idempotent); return the webhook Service's ClusterIP."""
    objects = select(render(cluster))
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", "-",
        stdin=yaml.safe_dump_all(objects),
    )  # fmt: skip
    cluster.wait_crds_established([CRD_NAME], timeout_s=60)
    ip = cluster.kubectl("get", "service", "-n", NAMESPACE, WEBHOOK_SERVICE, "-o", "jsonpath={.spec.clusterIP}")
    progress(f"lws: {len(objects)} objects of its chart applied")
    return ip.stdout.strip()


def host_services(cluster_ip: str, webhook_port: int) -> dict[str, Any]:
    """The egress proxy's entry for the webhook Service: its ClusterIP:443 -> the host process's port."""
    return {
        f"{NAMESPACE}/{WEBHOOK_SERVICE}": {
            "clusterIP": cluster_ip,
            "ports": [443],
            "address": "127.0.0.1",
            "targetPorts": {"443": webhook_port},
        }
    }


def write_config(webhook_port: int, health_port: int) -> None:
    LWS_DIR.mkdir(parents=True, exist_ok=True)
    CERT_DIR.mkdir(parents=True, exist_ok=True)
    CONFIG_FILE.write_text(yaml.safe_dump(configuration(webhook_port, health_port)))


def sync_certificates(cluster: Cluster, timeout_s: float = 90) -> None:
    sync_from_secret(cluster, NAMESPACE, CERT_SECRET, CERT_DIR, timeout_s)
