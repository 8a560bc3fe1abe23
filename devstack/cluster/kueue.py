"""Kueue in the local stack: its controller manager from its Go module (go/kueue), its own API objects from its
own Helm chart, and its own certificate management.

How it runs here, and why:
- The binary (`sigs.k8s.io/kueue/cmd/kueue`, built by build.py like the control plane) runs on the host beside
  the other components, with the admin kubeconfig, bound to 127.0.0.1 on free ports (several stacks share this
  machine), no leader election, no metrics or visibility server.
- Its objects come from the chart shipped in Kueue's Go module (`charts/kueue`, rendered by the stack's helm):
  the CRDs (with their conversion webhooks), the webhook configurations and Service, and the empty Secret that
  Kueue's internal certificate management fills. Left out: its Deployment (the binary runs on the host), RBAC
  (it runs as admin), the visibility APIService (an unanswered aggregated API would break discovery for every
  client) and the webhooks of integrations other than Kueue's own API: Kueue's pod, Job, Deployment and
  StatefulSet webhooks fail closed, so with them every pod creation in the stack would depend on Kueue.
- Certificates: Kueue's rotator creates a CA and a serving certificate for `kueue-webhook-service.kueue-system.svc`
  in that Secret and injects the CA into the webhook configurations and CRDs itself; in a pod the kubelet would
  then mount the Secret where the webhook server reads it, so here `up` copies the Secret's keys into the
  certificate directory (the rotator waits for that file, as for a mounted Secret).
- The API server reaches the webhook Service through the stack's egress proxy (egress.py): the Service has no
  selector, and `host-services.json` maps its ClusterIP:443 to the host process's webhook port.
- Configured with Loom's TrainingJob and InferenceService as external frameworks
  (`integrations.externalFrameworks`): Kueue then knows Workloads owned by them as jobs' Workloads; Loom creates
  them and starts the pods on admission.
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

KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_VERSION = "v0.17.0"
NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
CERT_SECRET = "kueue-webhook-server-cert"
# Loom's kinds that Kueue queues as external frameworks (Kind.version.group).
EXTERNAL_FRAMEWORKS = ("TrainingJob.v1alpha1.loom.dev", "InferenceService.v1alpha1.loom.dev")
KUEUE_DIR = STACK_DIR / "kueue"
CONFIG_FILE = KUEUE_DIR / "config.yaml"
CERT_DIR = KUEUE_DIR / "certs"
KUEUE_GROUP = "kueue.x-k8s.io"
CRD_NAMES = (
    "admissionchecks", "clusterqueues", "cohorts", "localqueues", "multikueueclusters", "multikueueconfigs",
    "provisioningrequestconfigs", "resourceflavors", "topologies", "workloadpriorityclasses", "workloads",
)  # fmt: skip
# Kinds of the chart applied as they are (the webhook configurations and the Service are adapted first).
KEPT_KINDS = frozenset({"CustomResourceDefinition", "Secret"})

Progress = Callable[[str], None]


def chart_dir() -> Path:
    return cache_root() / f"kueue-{KUEUE_VERSION}" / "chart"


def fetch_chart(progress: Progress = print) -> Path:
    """Copy Kueue's Helm chart out of its Go module (the module build.py compiles; in Go's module cache) once."""
    if (chart_dir() / "Chart.yaml").is_file():
        return chart_dir()
    final = copy_tree_out(module_dir(KUEUE_MODULE, KUEUE_VERSION) / "charts" / "kueue", chart_dir())
    progress(f"kueue: chart of {KUEUE_MODULE} {KUEUE_VERSION} -> {final}")
    return final


def configuration(webhook_port: int, health_port: int, cert_dir: Path = CERT_DIR) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for the host process."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here, and it would need a port per stack
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": CERT_SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": list(EXTERNAL_FRAMEWORKS)},
        # The visibility API server would bind 0.0.0.0:8082 (one per machine); partial admission is how an elastic
        # TrainingJob's minReplicas is admitted.
        "featureGates": {"VisibilityOnDemand": False, "PartialAdmission": True},
    }


def _only_kueue_api(webhook_config: dict[str, Any]) -> dict[str, Any]:
    """A webhook configuration with only the webhooks of Kueue's own API group."""
    kept = [
        w
        for w in webhook_config.get("webhooks") or []
        if all(set(r.get("apiGroups") or [""]) <= {KUEUE_GROUP} for r in w.get("rules") or [])
    ]
    return {**webhook_config, "webhooks": kept}


def select(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the chart's objects, what the host-run Kueue needs, adapted (see the module's docstring)."""
    out: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    for doc in rendered:
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
        if kind in KEPT_KINDS:
            out.append(doc)
        elif kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            out.append(_only_kueue_api(doc))
        elif kind == "Service" and name == WEBHOOK_SERVICE:
            spec = {k: v for k, v in doc["spec"].items() if k != "selector"}  # served from the host
            out.append({**doc, "spec": spec})
    return out


def render(cluster: Cluster) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", "kueue", str(fetch_chart()), "--namespace", NAMESPACE],
        capture_output=True,
        text=True,
        env=cluster.env,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"helm template of Kueue's chart failed: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def install(cluster: Cluster, progress: Progress = print) -> str:
    """Apply Kueue's objects (idempotent); return the webhook Service's ClusterIP."""
    objects = select(render(cluster))
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", "-",
        stdin=yaml.safe_dump_all(objects),
    )  # fmt: skip
    cluster.wait_crds_established([f"{n}.{KUEUE_GROUP}" for n in CRD_NAMES], timeout_s=60)
    ip = cluster.kubectl("get", "service", "-n", NAMESPACE, WEBHOOK_SERVICE, "-o", "jsonpath={.spec.clusterIP}")
    progress(f"kueue: {len(objects)} objects of its chart applied")
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
    KUEUE_DIR.mkdir(parents=True, exist_ok=True)
    CERT_DIR.mkdir(parents=True, exist_ok=True)
    CONFIG_FILE.write_text(yaml.safe_dump(configuration(webhook_port, health_port)))


def sync_certificates(cluster: Cluster, timeout_s: float = 90) -> None:
    """What a Secret volume would do: put the Secret's keys, once Kueue's rotator wrote them, in the cert dir."""
    sync_from_secret(cluster, NAMESPACE, CERT_SECRET, CERT_DIR, timeout_s)
