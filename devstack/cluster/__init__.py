"""Local control plane: build from Go modules, start/stop, kubeconfig.

Dev and test tooling only; the operator never imports it (the `loom dev` commands import it lazily).
"""

from loom.devstack.cluster.handle import Cluster, KubectlError
from loom.devstack.cluster.lifecycle import StackConfig, current, down, status, up

__all__ = ["Cluster", "KubectlError", "StackConfig", "current", "down", "status", "up"]
