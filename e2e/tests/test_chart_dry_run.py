"""charts/loom rendered with `helm template` for every values file in charts/loom/ci/ (the least an install needs:
the registry path of Loom's images; the maximal one turns every option on), each accepted by the real API server in
a server-side dry run. The chart's own defaults name no image (Loom publishes none) and are refused.

The ServiceMonitor of the maximal values is checked against the Prometheus Operator's own CRD, taken from its Go
module (like KEDA's in loom.devstack.cluster.keda): installed for real when the cluster lacks it, as are the
chart's CRDs, so the dry run validates every object against a real schema. Nothing else is created.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.gomod import module_dir
from loom.e2e.helm_operator import CHART, helm
from loom.operator.settings import OperatorSettings

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(180)]

PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
SERVICEMONITOR_CRD = "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))


def servicemonitor_crd() -> Path:
    """The ServiceMonitor CRD file in Go's module cache (downloaded and checksum-verified by `go mod download`)."""
    return module_dir(PROMETHEUS_OPERATOR_MODULE, PROMETHEUS_OPERATOR_VERSION) / SERVICEMONITOR_CRD


def ensure_crd(cluster: Cluster, path: Path) -> None:
    """Install a CRD for real unless the cluster has it already (the shared stack keeps what it has)."""
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    if cluster.kubectl("get", "crd", name, check=False).returncode == 0:
        return
    cluster.kubectl("apply", "--server-side", "-f", str(path))
    cluster.wait_crds_established([name], timeout_s=60)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    for path in sorted((CHART / "crds").glob("*.yaml")):
        ensure_crd(cluster, path)
    ensure_crd(cluster, servicemonitor_crd())


_rendered: dict[tuple[Path, ...], str] = {}


def render(cluster: Cluster, *values: Path) -> str:
    """`helm template` output, rendered once per values files for the whole module."""
    if values not in _rendered:
        extra = [arg for v in values for arg in ("-f", str(v))]
        args = ("template", "dry", str(CHART), "-n", "default", "--include-crds", *extra)
        _rendered[values] = helm(cluster, *args).stdout
    return _rendered[values]


def documents(rendered: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered) if d]


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.name)
def test_lint_and_server_side_dry_run(cluster: Cluster, crds: None, values: Path) -> None:
    lint = helm(cluster, "lint", "--strict", str(CHART), "-f", str(values))
    assert "0 chart(s) failed" in lint.stdout, lint.stdout
    rendered = render(cluster, values)
    # --force-conflicts: the shared stack's CRDs may have been installed by another manager (helm) from another
    # revision of crds/; a dry run takes the fields over on paper only, and every object is still validated.
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--server-side", "--force-conflicts", "-f", "-", stdin=rendered, check=False
    )
    assert result.returncode == 0, result.stderr
    # kubectl names every object the API server accepted; none was left out.
    accepted = result.stdout.count("serverside-applied (server dry run)")
    assert accepted == len(documents(rendered)), result.stdout


def test_the_maximal_values_render_every_optional_object(cluster: Cluster) -> None:
    docs = documents(render(cluster, CHART / "ci" / "max-values.yaml"))
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("ServiceMonitor", "PodDisruptionBudget", "ClusterKopfPeering", "ValidatingWebhookConfiguration"):
        assert kind in kinds, kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    # Digests pin where given (the tag is then not used); a repository of its own wins over image.registry.
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/platform/loom-operator@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    assert env["LOOM_TRAINER_IMAGE"] == "registry.example/loom/trainer@sha256:" + "1" * 64
    assert env["LOOM_SERVER_IMAGE"] == "registry.example/loom/server:1.2.3"
    assert env["LOOM_ROUTER_IMAGE"] == "registry.example/loom/router:1.2.4"
    assert env["LOOM_FEATURES_IMAGE"] == "registry.example/loom/features:1.2.3"
    assert env["LOOM_VLLM_IMAGE"] == "registry.example/loom/vllm:1.2.3"
    assert env["LOOM_PROMETHEUS_URL"] == "http://prometheus-operated.monitoring:9090"
    assert env["LOOM_LOG_FORMAT"] == "json" and env["LOOM_LOG_LEVEL"] == "DEBUG"
    assert env["LOOM_AUTOSCALE_INTERVAL_S"] == "10" and env["NO_PROXY"] == ".svc,.cluster.local"
    assert deployment["spec"]["replicas"] == 2
    # The endpoint defaults and the activator's bounds, as settings the operator accepts.
    settings = OperatorSettings.from_env({k: v for k, v in env.items() if k.startswith("LOOM_") and v is not None})
    assert (settings.default_s3_endpoint, settings.default_s3_secret_name, settings.default_mlflow_tracking_uri) == (
        "http://minio.storage:9000",
        "s3-credentials",
        "http://mlflow.mlops:5000",
    )
    assert (settings.activator_timeout_s, settings.activator_max_held) == (30.5, 500)
    # One dashboard ConfigMap per file, in the namespace Grafana's sidecar watches, with its label.
    dashboards = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert set(dashboards) == {f"dry-operator-dashboard-{n}" for n in ("autoscaling", "serving", "training")}
    for cm in dashboards.values():
        assert cm["metadata"]["namespace"] == "kube-public"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (key, text), *_ = cm["data"].items()
        assert json.loads(text)["uid"] == key.removesuffix(".json")
    # The least values (the chart's defaults plus the registry) render none of the optional objects.
    default_kinds = {d["kind"] for d in documents(render(cluster, CHART / "ci" / "registry-values.yaml"))}
    assert not default_kinds & {"ServiceMonitor", "PodDisruptionBudget", "ClusterKopfPeering", "ConfigMap"}
