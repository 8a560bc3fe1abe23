"""Part 1: the local real stack, what the examples expect a cluster to have, and Loom from its Helm chart.

The stack (`loom dev up`'s) is reused when running. What the examples need comes from loom.devstack.backing, as
for `loom dev up`: S3, MLflow, Redis and the stack's Prometheus (prometheus.monitoring.svc:9090), which the
operator, installed in the cluster with the chart, reads queue depth from; `loom dev down` stops them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import yaml

from loom.devstack import backing
from loom.devstack.cluster import Cluster, StackConfig, current, up
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.e2e.helm_operator import CHART, helm, wait_default_service_account
from loom.e2e.pytest_operator import apply_crds
from loom.e2e.stack_images import CHART_VALUES

from .stage import API_KEY_SECRET, NAMESPACE, WORKDIR, Demo, Outcome, wait

RELEASE, RELEASE_NAMESPACE = "loom", "loom-system"
PROMETHEUS_URL = backing.PROMETHEUS_URL
OPERATOR = f"{RELEASE}-operator"


def stack(progress: Any) -> tuple[Cluster, bool]:
    """The running stack, or one started now (built first on a fresh clone: many minutes)."""
    running = current()
    return (running, False) if running is not None else (up(StackConfig(), progress), True)


def values() -> dict[str, Any]:
    return {
        # The images the node agent records (it runs this checkout's code): loom.devstack.images.
        **CHART_VALUES,
        "watchNamespaces": [NAMESPACE],
        "prometheus": {"url": PROMETHEUS_URL},
        # Status every second (the progress bar), the default autoscaler round.
        "settings": {"training_poll_s": 1},
        # The only node that really runs pods; the examples' pods need most of its 2 CPUs.
        "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "1Gi"}},
    }


def clear_namespace(demo: Demo) -> None:
    """What an earlier run left in the demo namespace, removed while the operator runs (its finalizers)."""
    names = demo.kubectl("get", "loom", "-n", NAMESPACE, "-o", "name", check=False).stdout.split()
    if not names:
        return
    demo.ui.info(f"removing {len(names)} Loom objects an earlier run left in {NAMESPACE}")
    demo.kubectl("delete", "loom", "--all", "-n", NAMESPACE, "--timeout=120s", check=False)
    demo.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--wait=false", check=False)


def run(demo: Demo) -> Outcome:
    ui, cluster = demo.ui, demo.cluster
    demo.services = backing.ensure(cluster, progress=ui.info)
    if cluster.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", NAMESPACE)
    wait_default_service_account(cluster, NAMESPACE)
    # What the examples' comments tell a user to create in a namespace other than default.
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump(backing.credentials_secret(NAMESPACE)))
    demo.api_key = uuid.uuid4().hex
    cluster.kubectl("delete", "secret", API_KEY_SECRET, "-n", NAMESPACE, "--ignore-not-found")
    cluster.kubectl(
        "create", "secret", "generic", API_KEY_SECRET, "-n", NAMESPACE, f"--from-literal=keys={demo.api_key}"
    )
    apply_crds(cluster)  # the chart installs CRDs only on first install; these are this checkout's
    values_file = WORKDIR / "values.yaml"
    values_file.write_text(yaml.safe_dump(values()))
    started = time.monotonic()
    helm(
        cluster,
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "-n",
        RELEASE_NAMESPACE,
        "--create-namespace",
        "-f",
        str(values_file),
        "--wait",
        "--timeout=5m",
        timeout=330,
    )
    ready_s = time.monotonic() - started
    version = helm(cluster, "list", "-n", RELEASE_NAMESPACE, "-o", "yaml").stdout
    chart = next((r["chart"] for r in yaml.safe_load(version) or [] if r["name"] == RELEASE), "loom")
    ui.info(f"helm upgrade --install {RELEASE} charts/loom -n {RELEASE_NAMESPACE}: {chart}, operator Ready")
    demo.facts["prometheus"] = demo.services.prometheus_url
    ui.info(f"Prometheus {PROMETHEUS_URL} (from this machine: {demo.facts['prometheus']})")
    clear_namespace(demo)
    wait(lambda: not demo.kubectl("get", "loom", "-n", NAMESPACE, "-o", "name").stdout.strip(), 120, "old objects gone")
    return Outcome(
        f"Loom installed with Helm ({chart}), its operator running in the cluster, watching {NAMESPACE}",
        f"operator Ready {ready_s:.0f}s after helm install",
    )
