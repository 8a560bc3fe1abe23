"""Local control plane: build from Go modules, start/stop, kubeconfig.

Dev and test tooling only; the operator never imports it (the `loom dev` commands import it lazily).
"""

from loom.e2e.stack.cluster import Cluster, KubectlError
from loom.e2e.stack.stack import StackConfig, current, down, status, up

__all__ = ["Cluster", "KubectlError", "StackConfig", "current", "down", "status", "up"]
