"""Pytest plugin (registered with `-p loom.e2e.pytest_operator`): the real Loom operator against the local stack.

Fixtures:

- ``loom_operator`` (session): CRDs applied, then `loom operator` started as a subprocess with the stack's
  kubeconfig. It watches only namespaces named ``<prefix>-*`` (the prefix is random per session), so test
  sessions running side by side never reconcile each other's objects. Its log is ``loom_operator.log``.
- ``operator_namespace`` (function): a fresh namespace the session's operator watches; deleted after the test.

Tuning for tests (all plain LOOM_* settings): free ports for the health and metrics endpoints, fast progress
polling and a short node-lost grace period. `operator_process(..., defaults=True)` runs it with every setting at
its default instead (only the namespaces it watches are set), as the README tells a user to run it.
`operator_namespace_for(cluster, op)` gives any such operator a fresh namespace it watches.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.images import IMAGE_ENV, IMAGE_SETTINGS
from loom.devstack.servers import free_port
from loom.e2e.secrets_scan import record_namespace
from loom.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class OperatorProcess:
    namespace_prefix: str
    log: Path
    metrics_port: int
    health_port: int
    env: dict[str, str]
    process: subprocess.Popen[bytes]

    def crash(self) -> None:
        """SIGKILL, as when the node under the operator dies: no clean-up code runs."""
        self.process.kill()
        self.process.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no operator log)"


def crd_names(folder: Path) -> list[str]:
    """The names of the CRDs a folder of CRD manifests (one a file) defines."""
    return [yaml.safe_load(path.read_text())["metadata"]["name"] for path in sorted(folder.glob("*.yaml"))]


def apply_crds(cluster: Any) -> None:
    """Apply Loom's CRDs and wait until the API server serves them."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    cluster.wait_crds_established(crd_names(REPO / "crds"), timeout_s=60)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def operator_process(
    cluster: Any,
    log: Path,
    extra_env: dict[str, str] | None = None,
    prefix: str | None = None,
    *,
    defaults: bool = False,
) -> Iterator[OperatorProcess]:
    """Run `loom operator` until the block ends (SIGTERM, then SIGKILL after 20 s).

    It watches namespaces `<prefix>-*`; a random prefix unless one is given (e.g. to restart an operator
    on the same namespaces). With `defaults` every other LOOM_* setting keeps its default (ports included), except
    the workload images, which have none (loom.devstack.images).
    """
    prefix = prefix or f"lo{uuid.uuid4().hex[:6]}"
    # With defaults, no LOOM_* of the caller's environment reaches the operator either.
    env = {k: v for k, v in cluster.env.items() if not (defaults and k.startswith("LOOM_"))}
    env.update(
        {
            "LOOM_NAMESPACES": f"{prefix}-*",
            **IMAGE_ENV,
            "PYTHONSAFEPATH": "1",
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost,::1",
            "no_proxy": "127.0.0.1,localhost,::1",
        }
    )
    default = OperatorSettings(**IMAGE_SETTINGS)
    metrics_port, health_port = default.metrics_port, default.health_port
    if not defaults:
        metrics_port, health_port = free_port(), free_port()
        env.update(
            {
                "LOOM_METRICS_PORT": str(metrics_port),
                "LOOM_HEALTH_PORT": str(health_port),
                "LOOM_TRAINING_POLL_S": "1",
                "LOOM_NODE_LOST_GRACE_S": "10",
            }
        )
    env.update(extra_env or {})
    # The `loom operator` command itself, with logging switched on so the log file tells what happened.
    launch = (
        "import logging, sys; "
        "logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s %(name)s: %(message)s'); "
        "from loom.operator.cli import main; sys.exit(main(['operator']))"
    )
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", launch], env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    handle = OperatorProcess(prefix, log, metrics_port, health_port, env, proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(health_port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"loom operator did not become healthy; log {log}:\n{handle.log_tail()}")
            time.sleep(0.3)
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def loom_operator(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    log = tmp_path_factory.mktemp("loom-operator") / "loom_operator.log"
    with operator_process(cluster, log) as handle:
        yield handle
    print(f"[loom operator] log: {log}", file=sys.__stderr__)


@pytest.fixture
def operator_namespace(loom_operator: OperatorProcess, cluster: Any) -> Iterator[str]:
    with operator_namespace_for(cluster, loom_operator) as name:
        yield name


@contextlib.contextmanager
def operator_namespace_for(cluster: Any, op: OperatorProcess) -> Iterator[str]:
    """A fresh namespace `op` watches, deleted (Loom objects first) when the block ends."""
    name = f"{op.namespace_prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "loom.dev/e2e=true")
    deadline = time.monotonic() + 30
    # Pods are refused until the service-account controller has created `default`.
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}")
        time.sleep(0.25)
    try:
        yield name
    finally:
        with cluster.api_client() as api:  # its events and pod logs go with it
            record_namespace(api, name, AGENT_STATE_DIR / "logs")
        # Loom objects go first, while the operator still runs: one whose kind keeps a Kopf finalizer would
        # otherwise hold the namespace in Terminating forever once the operator has stopped.
        cluster.kubectl("delete", "loom", "--all", "-n", name, "--timeout=60s", check=False)
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
