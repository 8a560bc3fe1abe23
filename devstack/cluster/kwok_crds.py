"""kwok's PortForward CRD for the local stack, taken from kwok's Go module (the version the stack builds kwok from),
so kwok's kubelet server forwards a pod's port where a PortForward object says (`kwok --enable-crds=PortForward`).

kwok pretends to run the pods of its nodes; nothing listens at their addresses. A PortForward named like a pod (in
its namespace) tells kwok where a `kubectl port-forward` (or the SDK's loom.client.PortForward) to that pod goes:
`spec.forwards: [{ports: [80], target: {address: 127.0.0.1, port: 8080}}]`. The API server opens the stream to
kwok's server (--server-address) like to any kubelet. Fetched like KEDA's CRDs (loom.devstack.cluster.keda).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from loom.devstack.cluster.gomod import copy_out, module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.paths import GO_MODULES_DIR, cache_root

KWOK_MODULE = "sigs.k8s.io/kwok"
CRD_FILES = ("kwok.x-k8s.io_portforwards.yaml",)
CRD_NAMES = ("portforwards.kwok.x-k8s.io",)
# What `--enable-crds` names for them (kwok's kinds).
ENABLED_KINDS = ("PortForward",)

Progress = Callable[[str], None]


def kwok_version() -> str:
    """The kwok version the stack's tools module builds (its go.mod's requirement)."""
    text = (GO_MODULES_DIR / "tools" / "go.mod").read_text()
    match = re.search(rf"^\s*{re.escape(KWOK_MODULE)} (v\S+)", text, flags=re.M)
    if match is None:
        raise RuntimeError(f"{KWOK_MODULE} is not required by {GO_MODULES_DIR / 'tools' / 'go.mod'}")
    return match.group(1)


def crd_dir() -> Path:
    return cache_root() / f"kwok-{kwok_version()}" / "crds"


def fetch(progress: Progress = print) -> Path:
    """Copy the CRDs out of kwok's Go module (downloaded into Go's module cache if needed); return their folder."""
    final = crd_dir()
    if all((final / name).is_file() for name in CRD_FILES):
        return final
    version = kwok_version()
    source = module_dir(KWOK_MODULE, version) / "kustomize" / "crd" / "bases"
    copy_out(source, CRD_FILES, final)
    progress(f"kwok: CRDs of {KWOK_MODULE} {version} -> {final}")
    return final


def install_crds(cluster: Cluster, progress: Progress = print) -> None:
    """Apply the CRDs and wait until the API server serves them (kwok's informer retries until then). Idempotent."""
    folder = fetch(progress)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", str(folder))
    cluster.wait_crds_established(CRD_NAMES, timeout_s=60)
