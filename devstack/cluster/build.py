"""Build the stack's Go programs from the modules under devstack/cluster/go/ and cache them.

Each module builds all of its `tool` packages in one `go build`, so the packages they share compile
once. Results go to <cache>/<module>-<digest>/bin, keyed by the module's go.mod, go.sum and link
flags: a second build, or a fresh clone on the same machine, finds them and does nothing. The
binaries of all modules are then linked into one directory for PATH.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from loom.devstack.cluster import gie, keda, kueue, lws
from loom.devstack.cluster.paths import GO_MODULES_DIR, cache_root

KUBERNETES_VERSION = "v1.37.2"
HELM_VERSION = "v4.3.1"
PROMETHEUS_VERSION = "3.16.0"  # Go module github.com/prometheus/prometheus v0.316.0
REGISTRY_VERSION = "v3.1.2"  # Go module github.com/distribution/distribution/v3 (go/registry/go.mod)
CONTAINERD_VERSION = "v2.4.2"  # go/containerd/go.mod
CNI_PLUGINS_VERSION = "v1.10.0"  # go/cni/go.mod

Progress = Callable[[str], None]


def _kubernetes_version_flags(version: str) -> tuple[str, ...]:
    """What Kubernetes' own build stamps in; without it every binary reports v0.0.0-master."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags: list[str] = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
        ]
    return tuple(flags)


@dataclass(frozen=True)
class GoModule:
    name: str
    binaries: tuple[str, ...]
    link_flags: tuple[str, ...] = ()
    # go names a binary after its package path minus a major-version suffix: etcd's is "server".
    renames: tuple[tuple[str, str], ...] = ()
    # Go build tags (Prometheus compiles in only Kubernetes discovery with them).
    tags: tuple[str, ...] = ()
    # What `go build` builds: the module's `tool` packages, or its own main package (".": the registry, whose
    # main.go links only the storage driver the stack uses).
    packages: tuple[str, ...] = ("tool",)

    @property
    def source_dir(self) -> Path:
        return GO_MODULES_DIR / self.name

    @property
    def ldflags(self) -> str:
        # -s -w: no symbol table or DWARF; the binaries are a third of the size and link faster.
        return " ".join(("-s", "-w", *self.link_flags))

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in ("go.mod", "go.sum"):
            h.update((self.source_dir / part).read_bytes())
        h.update(self.ldflags.encode())
        if self.tags:  # only when set, so the digests (and caches) of the other modules stay as they are
            h.update(",".join(self.tags).encode())
        for source in sorted(self.source_dir.glob("*.go")):  # a module's own main package (none in the others)
            h.update(source.name.encode() + source.read_bytes())
        h.update(f"{platform.system()}-{platform.machine()}".encode())
        return h.hexdigest()[:16]

    def bin_dir(self) -> Path:
        return cache_root() / f"{self.name}-{self.digest()}" / "bin"

    def is_built(self) -> bool:
        bin_dir = self.bin_dir()
        return all((bin_dir / name).is_file() for name in self.binaries)


MODULES: tuple[GoModule, ...] = (
    GoModule(
        "k8s",
        ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"),
        _kubernetes_version_flags(KUBERNETES_VERSION),
    ),
    GoModule("etcd", ("etcd",), renames=(("server", "etcd"),)),
    GoModule("tools", ("kwok", "helm"), (f"-X helm.sh/helm/v4/internal/version.version={HELM_VERSION}",)),
    # Build tags keep the ~30 other service-discovery mechanisms (and their cloud SDKs, one of which the
    # module proxy no longer serves) out of the binary: the local stack only needs Kubernetes discovery.
    GoModule(
        "prometheus",
        ("prometheus",),
        (f"-X github.com/prometheus/common/version.Version={PROMETHEUS_VERSION}",),
        tags=("remove_all_sd", "enable_kubernetes_sd"),
    ),
    # The CNCF distribution registry that `make images push` pushes to on the local stack (components.py).
    GoModule(
        "registry",
        ("registry",),
        (f"-X github.com/distribution/distribution/v3/version.version={REGISTRY_VERSION}",),
        packages=(".",),
    ),
    # Kueue's controller manager (kueue.py): quotas, fair sharing and preemption for queued TrainingJobs.
    GoModule("kueue", ("kueue",), (f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={kueue.KUEUE_VERSION}",)),
    # LeaderWorkerSet's controller manager (lws.py): multi-pod InferenceService replicas. Its main package is
    # sigs.k8s.io/lws/cmd, so go names the binary "cmd".
    GoModule(
        "lws", ("lws",), (f"-X sigs.k8s.io/lws/pkg/version.GitVersion={lws.LWS_VERSION}",), renames=(("cmd", "lws"),)
    ),
)


# The real node (realnode/): built only for `loom dev build --real-node` / `up --real-node`, so the default stack (and
# `make test`) does not pay its cold build. Its own bin directory, so the default stack's digest stays as it is.
NODE_MODULES: tuple[GoModule, ...] = (
    # The kubelet and kube-proxy: go/node has go/k8s's requirements and pins, so what they share with the control
    # plane is compiled once (tests/unit/test_stack_go_modules.py).
    GoModule("node", ("kubelet", "kube-proxy"), _kubernetes_version_flags(KUBERNETES_VERSION)),
    GoModule(
        "containerd",
        ("containerd", "containerd-shim-runc-v2", "ctr"),
        (f"-X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}",),
    ),
    GoModule("cni", ("bridge", "host-local", "loopback", "portmap")),
    GoModule("pause", ("pause",), packages=(".",)),
    # Cluster DNS for the real node's pods: CoreDNS v1.15.0 with four plugins (go/coredns/main.go).
    GoModule("coredns", ("coredns",), packages=(".",)),
)


# Built only by the benchmarks that run other projects' programs beside Loom's, each on demand
# (build_bench_binary), at the versions those figures name: Kubeflow's training-operator (bench/bench_kubeflow_p1.py)
# and GIE's reference endpoint picker. Never part of `make test` or the stack's digest.
BENCH_MODULES: tuple[GoModule, ...] = (
    GoModule("kubeflow", ("training-operator.v1",)),
    # bench/bench_prefix_routing.py's gie-epp arm (devstack/gie_epp.py runs it).
    GoModule("gie-epp", ("epp",)),
)


def stack_bin_dir() -> Path:
    """The one directory with every binary of the stack (links into the per-module caches)."""
    combined = hashlib.sha256("".join(m.digest() for m in MODULES).encode()).hexdigest()[:16]
    return cache_root() / f"bin-{combined}"


def is_built() -> bool:
    bin_dir = stack_bin_dir()
    return all((bin_dir / name).exists() for m in MODULES for name in m.binaries)


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """Two sessions (a test run and `loom dev build`) must not build into the same cache at once."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries: nothing depends on the host's libc, and no C compiler is needed.
    env["CGO_ENABLED"] = "0"
    # go.mod and go.sum are checked in; a build must never rewrite them.
    flags = [f for f in env.get("GOFLAGS", "").split() if not f.startswith(("-mod=", "-buildvcs="))]
    env["GOFLAGS"] = " ".join([*flags, "-mod=readonly", "-buildvcs=false"])
    return env


def _build_module(module: GoModule, progress: Progress) -> None:
    # The official tarball's location, for shells whose PATH lacks it.
    go = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if go is None:
        raise RuntimeError("the Go toolchain (go >= 1.26) is needed to build the local stack; `go` is not on PATH")
    final = module.bin_dir()
    final.parent.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{module.name}-", dir=final.parent.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared.
    tags = [f"-tags={','.join(module.tags)}"] if module.tags else []
    cmd = [go, "build", "-v", "-trimpath", *tags, f"-ldflags={module.ldflags}", "-o", f"{staging}/", *module.packages]
    progress(f"{module.name}: go build {', '.join(module.binaries)} (cold builds take a while)")
    started = time.monotonic()
    last_report = started
    compiled = 0
    tail: list[str] = []
    with subprocess.Popen(
        cmd,
        cwd=module.source_dir,
        env=_go_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        # With -v, go prints each package as it compiles it: a live count is the progress we can give.
        for line in proc.stdout:
            # "go: downloading ..." lines are module fetches, not compiled packages.
            compiled += not line.startswith("go: ")
            tail = ([*tail, line.rstrip()])[-40:]
            now = time.monotonic()
            if now - last_report >= 30:
                progress(f"{module.name}: {compiled} packages compiled, {now - started:.0f}s")
                last_report = now
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"go build of {module.name} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    for built_name, name in module.renames:
        (staging / built_name).rename(staging / name)
    missing = [name for name in module.binaries if not (staging / name).is_file()]
    if missing:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"go build of {module.name} produced no {', '.join(missing)}")
    shutil.rmtree(final.parent, ignore_errors=True)
    final.parent.mkdir(parents=True)
    staging.rename(final)
    progress(f"{module.name}: built in {time.monotonic() - started:.0f}s -> {final}")


def node_bin_dir() -> Path:
    """The real node's binaries (links into their modules' caches), apart from the default stack's."""
    combined = hashlib.sha256("".join(m.digest() for m in NODE_MODULES).encode()).hexdigest()[:16]
    return cache_root() / f"node-bin-{combined}"


def node_is_built() -> bool:
    return all((node_bin_dir() / name).exists() for m in NODE_MODULES for name in m.binaries)


def _link_bin_dir(target: Path, modules: tuple[GoModule, ...]) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".bin-", dir=target.parent))
    staging.chmod(0o755)
    for module in modules:
        for name in module.binaries:
            (staging / name).symlink_to(module.bin_dir() / name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def build(progress: Progress = print) -> Path:
    """Build whatever is not cached yet; return the directory holding all binaries."""
    with _build_lock():
        started = time.monotonic()
        for module in MODULES:
            if module.is_built():
                progress(f"{module.name}: cached at {module.bin_dir()}")
            else:
                _build_module(module, progress)
        keda.fetch(progress)  # not a binary: KEDA's CRDs, cached next to the binaries
        gie.fetch(progress)  # likewise GIE's InferencePool CRD
        kueue.fetch_chart(progress)  # likewise Kueue's chart (its CRDs and webhook configurations)
        lws.fetch_chart(progress)  # and LeaderWorkerSet's
        bin_dir = stack_bin_dir() if is_built() else _link_bin_dir(stack_bin_dir(), MODULES)
        progress(f"stack binaries ready in {bin_dir} ({time.monotonic() - started:.1f}s)")
        return bin_dir


def build_node(progress: Progress = print) -> Path:
    """Build the real node's programs (kubelet, kube-proxy, containerd, CNI plugins, pause) not cached yet."""
    with _build_lock():
        started = time.monotonic()
        for module in NODE_MODULES:
            if module.is_built():
                progress(f"{module.name}: cached at {module.bin_dir()}")
            else:
                _build_module(module, progress)
        bin_dir = node_bin_dir() if node_is_built() else _link_bin_dir(node_bin_dir(), NODE_MODULES)
        progress(f"real node binaries ready in {bin_dir} ({time.monotonic() - started:.1f}s)")
        return bin_dir


def build_bench_binary(binary: str, progress: Progress = print) -> Path:
    """One benchmark's binary (its module built if not cached yet, the other bench modules left alone)."""
    module = next((m for m in BENCH_MODULES if binary in m.binaries), None)
    if module is None:
        raise ValueError(f"no bench module builds {binary!r}: {[m.binaries for m in BENCH_MODULES]}")
    with _build_lock():
        if not module.is_built():
            _build_module(module, progress)
    return module.bin_dir() / binary
