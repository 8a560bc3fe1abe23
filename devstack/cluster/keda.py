"""KEDA's own CRDs (ScaledObject, ScaledJob, TriggerAuthentication, ClusterTriggerAuthentication) for the local
stack, taken from KEDA's Go module: what Loom renders for `autoscaling.engine: keda` is checked against KEDA's
real schema by the API server, not against a copy of ours.

`go mod download` puts the module in Go's module cache (checked against the checksum database like every
other module of the stack); the CRD files are copied from it into <cache>/keda-<version>/crds, so a second
start, or a fresh clone on the same machine, finds them without Go. KEDA itself (its operator and metrics
server) is not run: only its API types are installed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loom.devstack.cluster.gomod import copy_out, module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.paths import cache_root

KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.21.0"
# The keda.sh group, as KEDA's own deployment (config/crd/kustomization.yaml) installs it; the eventing.keda.sh
# CloudEvent sources are left out (nothing in Loom renders them).
CRD_FILES = (
    "keda.sh_scaledobjects.yaml",
    "keda.sh_scaledjobs.yaml",
    "keda.sh_triggerauthentications.yaml",
    "keda.sh_clustertriggerauthentications.yaml",
)
CRD_NAMES = tuple(f"{f.removeprefix('keda.sh_').removesuffix('.yaml')}.keda.sh" for f in CRD_FILES)

Progress = Callable[[str], None]


def crd_dir() -> Path:
    return cache_root() / f"keda-{KEDA_VERSION}" / "crds"


def is_fetched() -> bool:
    return all((crd_dir() / name).is_file() for name in CRD_FILES)


def fetch(progress: Progress = print) -> Path:
    """Copy KEDA's CRDs out of its Go module (downloaded into Go's module cache if needed); return their folder."""
    if is_fetched():
        return crd_dir()
    source = module_dir(KEDA_MODULE, KEDA_VERSION) / "config" / "crd" / "bases"
    final = crd_dir()
    copy_out(source, CRD_FILES, final)
    progress(f"keda: CRDs of {KEDA_MODULE} {KEDA_VERSION} -> {final}")
    return final


def install_crds(cluster: Cluster, progress: Progress = print) -> None:
    """Apply KEDA's CRDs (server-side: the ScaledObject CRD is too big for client-side apply's annotation) and
    wait until the API server serves them. Idempotent."""
    folder = fetch(progress)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", str(folder))
    cluster.wait_crds_established(CRD_NAMES, timeout_s=60)
