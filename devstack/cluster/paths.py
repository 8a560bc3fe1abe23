"""Where the local stack keeps its sources, its cached binaries and its runtime state."""

from __future__ import annotations

import os
from pathlib import Path

# The stack is dev tooling used from a checkout (editable install): devstack/cluster/ sits two levels
# below the repository root.
REPO_ROOT = Path(__file__).resolve().parents[2]
GO_MODULES_DIR = Path(__file__).resolve().parent / "go"
KWOK_STAGES_FILE = Path(__file__).resolve().parent / "kwok-stages.yaml"
AGENT_MAIN = REPO_ROOT / "devstack" / "agent" / "__main__.py"
# The images the node agent runs from another local environment than the project's .venv (it pulls no image):
# the vllm runtime's image is the vLLM engine's own environment, `make venv-vllm`'s .venv-vllm (issue 24).
AGENT_IMAGE_ENVIRONMENTS = {"vllm": REPO_ROOT / ".venv-vllm" / "bin"}

# Runtime state lives in the git-ignored .state/ of the checkout, so every clone has its own cluster.
STATE_DIR = Path(os.environ.get("LOOM_STATE_DIR", REPO_ROOT / ".state"))
STACK_DIR = STATE_DIR / "stack"
PKI_DIR = STACK_DIR / "pki"
ETCD_DATA_DIR = STACK_DIR / "etcd-data"
LOG_DIR = STACK_DIR / "logs"
RUN_DIR = STACK_DIR / "run"
USERS_DIR = STACK_DIR / "users"
KUBECONFIG = STACK_DIR / "admin.kubeconfig"
STACK_FILE = STACK_DIR / "stack.json"
LOCK_FILE = STACK_DIR / ".lock"
AGENT_STATE_DIR = STATE_DIR / "agent"
REGISTRY_CONFIG = STACK_DIR / "registry.yaml"
# The API server's audit log: only the requests of the audited operator identity (components.AUDITED_USER).
AUDIT_POLICY = STACK_DIR / "audit-policy.yaml"
AUDIT_LOG = LOG_DIR / "audit.log"
REGISTRY_DATA_DIR = STACK_DIR / "registry-data"


def cache_root() -> Path:
    """Binaries are cached outside the checkout, so a fresh clone on the same machine reuses them."""
    if override := os.environ.get("LOOM_STACK_CACHE"):
        return Path(override)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "loom" / "stack"
