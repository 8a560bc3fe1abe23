"""The Gateway API Inference Extension's InferencePool CRD (`inference.networking.k8s.io/v1`) for the local stack,
taken from GIE's Go module: the InferencePool Loom renders for a routed vllm InferenceService
(operator/kinds/inferenceservice/traffic/pool.py) is checked by the API server against GIE's own schema (its CEL
rules included), the schema every conformant gateway reads.

Fetched and cached like KEDA's CRDs (loom.devstack.cluster.keda): `go mod download` puts the module in Go's module
cache, the CRD file is copied into <cache>/gie-<version>/crds, so a later start finds it without Go. v1.1.0 is the
release whose tree holds the conformance suite (conformance/) that the picker's ext_proc side is run against.
Only the stable InferencePool is installed with the stack; the x-k8s.io alpha kinds (InferenceObjective,
InferencePoolImport) are not (nothing in Loom renders them). GIE's reference endpoint picker watches
InferenceObjectives and does not start without their CRD: install_epp_crds adds it, for the benchmark that runs that
picker (devstack/gie_epp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loom.devstack.cluster.gomod import copy_out, module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.paths import cache_root

GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION = "v1.1.0"
CRD_FILES = ("inference.networking.k8s.io_inferencepools.yaml",)
CRD_NAMES = ("inferencepools.inference.networking.k8s.io",)
EPP_CRD_FILES = ("inference.networking.x-k8s.io_inferenceobjectives.yaml",)
EPP_CRD_NAMES = ("inferenceobjectives.inference.networking.x-k8s.io",)

Progress = Callable[[str], None]


def crd_dir() -> Path:
    return cache_root() / f"gie-{GIE_VERSION}" / "crds"


def is_fetched() -> bool:
    return all((crd_dir() / name).is_file() for name in CRD_FILES)


def fetch(progress: Progress = print) -> Path:
    """Copy GIE's InferencePool CRD out of its Go module (downloaded into Go's module cache if needed)."""
    if is_fetched():
        return crd_dir()
    source = module_dir(GIE_MODULE, GIE_VERSION) / "config" / "crd" / "bases"
    final = crd_dir()
    copy_out(source, CRD_FILES, final)
    progress(f"gie: InferencePool CRD of {GIE_MODULE} {GIE_VERSION} -> {final}")
    return final


def install_crds(cluster: Cluster, progress: Progress = print) -> None:
    """Apply the InferencePool CRD (server-side, as KEDA's) and wait until the API server serves it. Idempotent."""
    folder = fetch(progress)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", str(folder))
    cluster.wait_crds_established(CRD_NAMES, timeout_s=60)


def install_epp_crds(cluster: Cluster, progress: Progress = print) -> None:
    """Apply the InferenceObjective CRD that GIE's reference endpoint picker watches (its cache lists them at start)
    and wait until the API server serves it. Idempotent; not part of the stack's own start."""
    folder = cache_root() / f"gie-{GIE_VERSION}" / "epp-crds"
    if not all((folder / name).is_file() for name in EPP_CRD_FILES):
        copy_out(module_dir(GIE_MODULE, GIE_VERSION) / "config" / "crd" / "bases", EPP_CRD_FILES, folder)
        progress(f"gie: InferenceObjective CRD of {GIE_MODULE} {GIE_VERSION} -> {folder}")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", str(folder))
    cluster.wait_crds_established(EPP_CRD_NAMES, timeout_s=60)
