"""The local stack's Go modules share their common dependencies at one version each.

Go's build cache keys a compiled package by its source and the keys of everything it imports, so client-go
compiled for the API server is reused for kwok, helm and Prometheus only when every module under it has the
same version in all of them. A cold `make test` spends most of its first phase compiling these modules; a
single drifted low-level module (golang.org/x/sys, say) would make the other modules compile Kubernetes' client
libraries again, minutes on a 2-core machine. etcd stays apart: its server is v3.6, the API server's client
libraries are v3.7 (devstack/cluster/README.md).
"""

from __future__ import annotations

import re

from loom.devstack.cluster.build import MODULES
from loom.devstack.cluster.paths import GO_MODULES_DIR

SHARING = ("k8s", "tools", "prometheus")
_REQUIRE = re.compile(r"^\s*(?:require\s+)?([\w./~-]+)\s+(v\S+)(?:\s*//.*)?$", re.M)
_REPLACE = re.compile(r"^\s*(?:replace\s+)?([\w./~-]+)\s*=>\s*[\w./~-]+\s+(v\S+)", re.M)


def requirements(go_mod: str) -> dict[str, str]:
    """Module path -> the version the build uses (a `replace` with a version wins over the requirement)."""
    versions = {m.group(1): m.group(2) for m in _REQUIRE.finditer(go_mod)}
    versions.update({m.group(1): m.group(2) for m in _REPLACE.finditer(go_mod)})
    versions.pop("go", None)
    return versions


def test_requirements_reads_requires_and_versioned_replaces() -> None:
    go_mod = """module x

go 1.26.0

require k8s.io/kubernetes v1.37.2

require (
\tgolang.org/x/sys v0.49.0 // indirect
\tk8s.io/api v0.0.0 // indirect
)

replace (
\tk8s.io/api => k8s.io/api v0.37.2
)
"""
    assert requirements(go_mod) == {
        "k8s.io/kubernetes": "v1.37.2",
        "golang.org/x/sys": "v0.49.0",
        "k8s.io/api": "v0.37.2",
    }


def test_modules_that_share_dependencies_require_each_at_one_version() -> None:
    assert set(SHARING) <= {m.name for m in MODULES}
    by_module = {name: requirements((GO_MODULES_DIR / name / "go.mod").read_text()) for name in SHARING}
    drifted = {}
    for path in sorted(set().union(*by_module.values())):
        versions = {name: reqs[path] for name, reqs in by_module.items() if path in reqs}
        if len(set(versions.values())) > 1:
            drifted[path] = versions
    assert drifted == {}, (
        "raise each of these to the highest version in every module that requires it "
        f"(`go get path@version` in that module): {drifted}"
    )
    # The check has something to hold: Kubernetes' client libraries are required by all three.
    assert all("k8s.io/client-go" in reqs for reqs in by_module.values())


# The registry module (the CNCF distribution registry) shares the control plane's telemetry and RPC libraries (otel,
# grpc, protobuf, x/net, prometheus' client): at the same versions, its cold build compiles only what is its own.
# Newer in it, on purpose: distribution v3.1.2 requires these above what the others use; raising them there would
# rebuild Kubernetes for a leaf package.
REGISTRY_NEWER = {"github.com/sirupsen/logrus"}


def test_the_registry_module_requires_shared_dependencies_at_the_shared_versions() -> None:
    assert "registry" in {m.name for m in MODULES}
    shared: dict[str, set[str]] = {}
    for name in SHARING:
        for path, version in requirements((GO_MODULES_DIR / name / "go.mod").read_text()).items():
            shared.setdefault(path, set()).add(version)
    registry = requirements((GO_MODULES_DIR / "registry" / "go.mod").read_text())
    drifted = {
        path: (version, shared[path]) for path, version in registry.items() if shared.get(path, {version}) != {version}
    }
    assert set(drifted) == REGISTRY_NEWER, (
        "raise each of these in go/registry to the version the other modules use (`go get path@version`): "
        f"{ {p: v for p, v in drifted.items() if p not in REGISTRY_NEWER} }"
    )
    # Something is shared, so the check holds something: the telemetry and RPC stacks.
    assert {"google.golang.org/grpc", "go.opentelemetry.io/otel"} <= set(registry) & set(shared)


def test_the_real_node_module_requires_what_the_control_plane_requires_at_its_versions() -> None:
    """go/node (kubelet, kube-proxy) is go/k8s's module graph plus the node's own packages: every module both
    require is at go/k8s's version (staging pins included), so the kubelet's cold build compiles only what the
    control plane does not link. Newer modules of its own (netlink, nftables) may differ from Prometheus's."""
    k8s = requirements((GO_MODULES_DIR / "k8s" / "go.mod").read_text())
    node = requirements((GO_MODULES_DIR / "node" / "go.mod").read_text())
    drifted = {path: (version, k8s[path]) for path, version in node.items() if path in k8s and k8s[path] != version}
    assert drifted == {}, f"set these in go/node to go/k8s's versions (`go get path@version`): {drifted}"
    assert node["k8s.io/kubernetes"] == k8s["k8s.io/kubernetes"] == "v1.37.2"
    assert {"k8s.io/client-go", "google.golang.org/grpc"} <= set(node) & set(k8s)
