"""Agent settings and the folders it keeps under its state dir."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

POD_NETWORK = "127.10.0.0/16"


def default_host_paths() -> tuple[str, ...]:
    """Host folders every container runs from: the virtualenv and the checkout (an editable install)."""
    return (sys.prefix, str(Path(__file__).resolve().parents[2]))


@dataclass(frozen=True)
class AgentConfig:
    kubeconfig: str
    node_name: str
    state_dir: Path
    kubelet_port: int
    tls_cert: str | None
    tls_key: str | None
    gpus: int = 0
    cpu: str = str(os.cpu_count() or 1)
    memory: str = "8Gi"
    max_pods: int = 110
    host_ip: str = "127.0.0.1"
    backoff_initial: float = 2.0
    backoff_max: float = 60.0
    bin_dir: str = os.path.dirname(sys.executable)
    shim_path: str | None = None
    # Kept visible in every container even under a pod volume (a checkout under /tmp, an emptyDir at /tmp).
    host_paths: tuple[str, ...] = default_host_paths()
    # Image repository name -> the bin folder of the local environment standing for that image (plan.environment_for).
    image_environments: tuple[tuple[str, str], ...] = ()

    @property
    def pods_dir(self) -> Path:
        return self.state_dir / "pods"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"


def machine_memory() -> str:
    """Total memory of this machine as a Kubernetes quantity."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1])}Ki"
    except OSError:
        pass
    return "8Gi"
