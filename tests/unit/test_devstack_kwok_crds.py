"""kwok's PortForward CRD on the local stack: taken from the kwok version the stack builds, and enabled in kwok."""

from __future__ import annotations

import re
from pathlib import Path

from loom.devstack.cluster import kwok_crds
from loom.devstack.cluster.components import control_plane
from loom.devstack.cluster.paths import GO_MODULES_DIR


def test_the_crds_come_from_the_kwok_version_the_stack_builds() -> None:
    go_mod = (GO_MODULES_DIR / "tools" / "go.mod").read_text()
    (pinned,) = re.findall(r"sigs\.k8s\.io/kwok (v[0-9.]+)", go_mod)
    assert kwok_crds.kwok_version() == pinned
    assert kwok_crds.crd_dir().parent.name == f"kwok-{pinned}"


def test_kwok_watches_portforward_objects(tmp_path: Path) -> None:
    from loom.devstack.cluster.lifecycle import _pick_ports
    from loom.devstack.cluster.pki import ensure_pki

    pki = ensure_pki(tmp_path / "pki")
    components = {c.name: c for c in control_plane(tmp_path, pki, _pick_ports(None))}
    argv = components["kwok"].argv
    assert "--enable-crds=PortForward" in argv
    # kwok serves port-forwards only with its kubelet server on.
    assert any(a.startswith("--server-address=127.0.0.1:") for a in argv)
    assert kwok_crds.CRD_NAMES == ("portforwards.kwok.x-k8s.io",)
