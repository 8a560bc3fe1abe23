"""A handle on a running local cluster: kubeconfig, server, binaries, and ways to talk to it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kubernetes import client, config

T = TypeVar("T")


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr}"


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path
    server: str
    bin_dir: Path
    ca_cert: Path

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

    def shell_exports(self) -> str:
        return f"export KUBECONFIG={self.kubeconfig} PATH={self.bin_dir}:$PATH"


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
