"""A handle on a running local cluster: kubeconfig, server, binaries, and ways to talk to it."""

from __future__ import annotations

import math
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kubernetes import client, config

T = TypeVar("T")

# One `kubectl wait` round of `Cluster.wait_crds_established`: a CRD stuck Installing is nudged after each.
ESTABLISH_ROUND_S = 5


class StackError(RuntimeError):
    """Something the stack's user must do first (wipe its data, free the real node, become root): the CLI prints the
    message alone, without a traceback."""


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr}"


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path
    server: str
    bin_dir: Path
    ca_cert: Path
    # host:port of the stack's image registry (plain HTTP on loopback); empty for a stack started before it existed.
    registry: str = ""

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses: kubectl/helm/kwok first on PATH, the admin kubeconfig."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        # Any Python child must not put the repository root (with its `operator` folder) on sys.path.
        env["PYTHONSAFEPATH"] = "1"
        return env

    def api_client(self) -> client.ApiClient:
        """An admin client of the official kubernetes package; close it (or use `with`)."""
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the stack's kubectl; raises with its stderr when `check` and it fails."""
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            input=stdin,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, result.args, result.stdout, result.stderr)
        return result

    def wait_crds_established(self, names: Iterable[str], timeout_s: float) -> None:
        """Wait until the API server serves every CRD of `names` (condition Established), with one `kubectl wait`
        for all of them per round; raises KubectlError with kubectl's stderr after `timeout_s` seconds.

        A failed round is retried: kubectl wait fails at once, instead of waiting, on a just-created CRD whose
        status.conditions is still null (kubernetes/kubernetes#66439). And the API server establishes a CRD on an
        add or update event only, so one whose establishing was cut short by a stop (etcd keeps it Installing)
        stays so until it changes: the CRDs are annotated before each retry, which any update would do."""
        targets = [f"crd/{name}" for name in names]
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = max(1, math.ceil(min(deadline - time.monotonic(), ESTABLISH_ROUND_S)))
            wait = ("wait", "--for=condition=Established", f"--timeout={wait_s}s", *targets)
            result = self.kubectl(*wait, check=False, timeout=wait_s + 30)
            if result.returncode == 0:
                return
            if time.monotonic() >= deadline:
                raise KubectlError(result.returncode, result.args, result.stdout, result.stderr)
            self.kubectl("annotate", "--overwrite", *targets, f"loom.dev/establish={time.time():.0f}")
            time.sleep(0.5)  # a just-created CRD's conditions appear within milliseconds: no busy loop meanwhile

    def shell_exports(self) -> str:
        registry = f" LOOM_REGISTRY={self.registry}" if self.registry else ""
        return f"export KUBECONFIG={self.kubeconfig} PATH={self.bin_dir}:$PATH{registry}"


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25) -> T:
    """Poll until `predicate` returns something truthy and return it; TimeoutError names `what`.

    For tests: state converges through controllers, so assertions wait for it instead of sleeping.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
