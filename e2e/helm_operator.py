"""The Loom operator running in the cluster, installed from charts/loom with Helm, on the local stack.

`operator_in_cluster(cluster, watch=[...])` installs the chart into a fresh namespace, waits until the operator
pod is Ready on the node agent (which runs it as a local process with the chart's ServiceAccount token, the
cluster CA and the `KUBERNETES_SERVICE_*` variables, exactly what an in-cluster client reads), and uninstalls it
when the block ends. The operator then acts with the chart's RBAC, not the admin kubeconfig.

The handle offers what tests of the host-process operator use (`log_tail`), so a test written against
`loom.e2e.pytest_operator.OperatorProcess` can take an `InClusterOperator` instead. The fixture below
(`loom_operator_in_cluster`, module scope) is for test modules that import it; it is not registered globally.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.e2e.readme_install import adapt
from loom.e2e.stack_images import CHART_VALUES

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "loom"
READY_TIMEOUT_S = 120.0

# What every in-cluster test install sets: the images (the chart has no default; the node agent records them and
# runs this checkout, loom.devstack.images), fast polling like the host-process fixture, the pod on the node
# agent (the only node that really runs pods), a small CPU request (the agent's node has 2 CPUs to share).
TEST_VALUES: dict[str, Any] = {
    **CHART_VALUES,
    "settings": {"training_poll_s": 1, "node_lost_grace_s": 10},
    "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
    "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "1Gi"}},
}


def helm(cluster: Any, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run the stack's helm with the admin kubeconfig; a failure carries helm's stderr."""
    result = subprocess.run(
        [str(cluster.bin_dir / "helm"), *args], env=cluster.env, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


@dataclass
class InClusterOperator:
    cluster: Any
    release: str
    namespace: str
    watch: tuple[str, ...]
    values_file: Path
    installed: bool = field(default=True)

    @property
    def name(self) -> str:
        """The Deployment, ServiceAccount and ClusterRole name (`<release>-operator`)."""
        return f"{self.release}-operator"

    @property
    def namespace_prefix(self) -> str:
        """For a release watching one pattern `<prefix>-*` (as the host-process fixture does): the prefix, so a
        test written for `OperatorProcess` finds the namespaces this operator watches."""
        if len(self.watch) != 1 or not self.watch[0].endswith("-*"):
            raise ValueError(f"release {self.release} watches {list(self.watch)}, not one <prefix>-* pattern")
        return self.watch[0].removesuffix("-*")

    @property
    def user(self) -> str:
        """The identity the operator acts as."""
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    def pod(self) -> dict[str, Any] | None:
        out = self.cluster.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"app.kubernetes.io/instance={self.release}", "-o", "json"
        ).stdout
        pods = [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if pods else None

    def logs(self, tail: int = 400) -> str:
        """The operator's log through `kubectl logs` (the API server proxies it to the node agent)."""
        result = self.cluster.kubectl(
            "logs", f"deployment/{self.name}", "-n", self.namespace, f"--tail={tail}", check=False
        )
        return str(result.stdout if result.returncode == 0 else f"(no operator log: {result.stderr})")

    def log_tail(self, lines: int = 60) -> str:
        return self.logs(tail=lines)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            pod = self.pod()
            conditions = {c["type"]: c["status"] for c in ((pod or {}).get("status") or {}).get("conditions", [])}
            return pod if conditions.get("Ready") == "True" else None

        try:
            return dict(wait_until(ready, timeout=timeout, what=f"operator pod of {self.release} Ready", interval=1))
        except TimeoutError as error:
            pods = self.cluster.kubectl("get", "pods,events", "-n", self.namespace, check=False).stdout
            raise AssertionError(f"{error}\n{pods}\n{self.log_tail()}") from None

    def upgrade(self, *args: str) -> subprocess.CompletedProcess[str]:
        return helm(
            self.cluster, "upgrade", self.release, str(CHART), "-n", self.namespace, "-f", str(self.values_file), *args
        )

    def uninstall(self) -> None:
        if self.installed:
            helm(self.cluster, "uninstall", self.release, "-n", self.namespace, "--wait", "--ignore-not-found")
            self.installed = False


@contextlib.contextmanager
def operator_in_cluster(
    cluster: Any,
    watch: list[str],
    *,
    values: dict[str, Any] | None = None,
    workdir: Path,
    command: list[str] | None = None,
) -> Iterator[InClusterOperator]:
    """Install the chart (release `loom<random>` in namespace `<release>-system`) watching `watch`, wait for
    the operator pod to be Ready, yield; uninstall and delete its namespace afterwards. Exact namespaces in
    `watch` must exist before (the chart puts a RoleBinding into each). `command`: a README `helm install` to
    run instead, as written but for the release, its namespace and the watched namespaces (readme_install.adapt;
    the test values file comes last, and the command's own `--set` values win over it, as in Helm)."""
    release = f"loom{uuid.uuid4().hex[:6]}"
    namespace = f"{release}-system"
    settings = {**TEST_VALUES, "watchNamespaces": list(watch), **(values or {})}
    values_file = workdir / f"{release}-values.yaml"
    values_file.write_text(yaml.safe_dump(settings))
    cluster.kubectl("create", "namespace", namespace)
    handle = InClusterOperator(cluster, release, namespace, tuple(watch), values_file)
    try:
        if command is None:
            helm(cluster, "install", release, str(CHART), "-n", namespace, "-f", str(values_file))
        else:
            argv = adapt(command, release=release, namespace=namespace, watch=list(watch), extra_values=values_file)
            helm(cluster, *argv[1:])
        handle.wait_ready()
        yield handle
    finally:
        handle.uninstall()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def wait_default_service_account(cluster: Any, namespace: str) -> None:
    """Pods are refused until the service-account controller has created `default`."""
    wait_until(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0,
        timeout=30,
        what=f"default ServiceAccount in {namespace}",
    )


@pytest.fixture(scope="module")
def loom_operator_in_cluster(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InClusterOperator]:
    """An operator installed from the chart, watching one fresh namespace (`.watch[0]`) of its own."""
    watched = f"lw{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", watched)
    wait_default_service_account(cluster, watched)
    try:
        with operator_in_cluster(cluster, [watched], workdir=tmp_path_factory.mktemp("helm")) as handle:
            yield handle
            # Loom objects first, while the operator still runs (a Kopf finalizer would hold the namespace).
            cluster.kubectl("delete", "loom", "--all", "-n", watched, "--timeout=60s", check=False)
    finally:
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)
