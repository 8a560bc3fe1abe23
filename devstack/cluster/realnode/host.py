"""What the real node changes on the host, and how `loom dev down` puts every bit of it back.

A real node is machine-wide (its bridge and addresses, its sysctls and nftables tables): one per machine, claimed by
the stack (state folder) that started it in RUN_DIR/owner. Before it changes anything, `claim` records the sysctls'
values and which of the paths the node's programs create outside its state already existed; `release` undoes it
all: processes in the node's cgroups, mounts under its folders, pod network namespaces, veths and the bridge, the
nftables tables (the stack's guard, kube-proxy's, portmap's), sysctls, cgroups, created paths. Nothing that the
stack did not create is touched: other stacks on this machine (and their loopback services) are left alone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from loom.devstack.cluster.handle import StackError
from loom.devstack.cluster.realnode import config

Progress = Callable[[str], None]
# Short paths for sockets (a Unix socket's path is limited to 108 bytes) and machine-wide ownership.
RUN_DIR = Path("/run/loom-real-node")
OWNER_FILE = RUN_DIR / "owner"
SAVED_FILE = RUN_DIR / "saved.json"
# Paths the kubelet, containerd and the CNI plugins create outside any folder they are given.
FOREIGN_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/run/containerd",
    "/var/lib/cni",
    "/run/netns",
    "/etc/cni",
    "/opt/cni",
    "/opt/containerd",
)
CGROUP_BASE = Path("/sys/fs/cgroup")
NFT_TABLES = (
    ("inet", config.GUARD_TABLE),
    ("ip", "kube-proxy"),
    ("ip6", "kube-proxy"),
    ("inet", "cni_hostport"),
    ("ip", "cni_hostport"),
    ("ip6", "cni_hostport"),
)


class RealNodeError(StackError):
    pass


def _run(*argv: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RealNodeError(f"{' '.join(argv)} failed (exit {result.returncode}): {result.stderr.strip()}")
    return result


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str:
    return _sysctl_path(name).read_text().strip()


def write_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(f"{value}\n")


def owner() -> str | None:
    try:
        return OWNER_FILE.read_text().strip() or None
    except OSError:
        return None


def claim(state_dir: Path) -> None:
    """Make this stack the machine's real-node owner (refused while another stack's real node is up) and record what
    `release` restores. Idempotent for the owner: the first claim's record is kept."""
    if os.geteuid() != 0:
        raise RealNodeError("the real node needs root (bridges, network namespaces, cgroups, mounts)")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            raise RealNodeError(f"the real node needs `{tool}` (apt-get install iproute2 nftables)")
    current = owner()
    if current is not None and current != str(state_dir):
        raise RealNodeError(f"this machine's real node belongs to the stack in {current}: `loom dev down` there first")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    OWNER_FILE.write_text(str(state_dir))
    if not SAVED_FILE.exists():
        saved = {
            "sysctls": {name: read_sysctl(name) for name in config.SAVED_SYSCTLS},
            "existed": [path for path in FOREIGN_PATHS if os.path.lexists(path)],
        }
        SAVED_FILE.write_text(json.dumps(saved, indent=2))


def overlapping_routes(routes: str, ranges: Iterable[str]) -> list[str]:
    """The lines of `ip -o -4 route show table all` (or `ip -o -4 addr`) on another device than the node's bridge
    whose network overlaps one of `ranges`: the node must never take over an address or route of the host's (this
    VM's own network is 192.0.2.0/24, say)."""
    networks = [ipaddress.ip_network(r, strict=False) for r in ranges]
    clashes = []
    for line in routes.splitlines():
        words = line.split()
        device = words[words.index("dev") + 1] if "dev" in words else (words[1] if len(words) > 1 else "")
        if device in (config.BRIDGE, config.HOST_LINK):
            continue
        for word in words:
            try:
                network = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if network.version == 4 and network.prefixlen > 0 and any(network.overlaps(n) for n in networks):
                clashes.append(line.strip())
                break
    return clashes


def setup_network(progress: Progress) -> None:
    """The bridge with the node's address, forwarding, bridged traffic through conntrack, and the guard table."""
    ranges = (f"{config.NODE_IP}/{config.NODE_PREFIX}", config.POD_CIDR, config.SERVICE_CIDR)
    found = _run("ip", "-o", "-4", "route", "show", "table", "all").stdout + _run("ip", "-o", "-4", "addr").stdout
    clashes = overlapping_routes(found, ranges)
    if clashes:
        raise RealNodeError(
            f"the real node's address ranges {', '.join(ranges)} are in use on this host: " + "; ".join(clashes)
        )
    # The host link is a bridge with no ports too: this kernel has no dummy links (no modules).
    for link, kind in ((config.BRIDGE, "bridge"), (config.HOST_LINK, "bridge")):
        if _run("ip", "link", "show", link, check=False).returncode != 0:
            _run("ip", "link", "add", link, "type", kind)
            progress(f"real node: {kind} {link} created")
        _run("ip", "link", "set", link, "up")
    address = f"{config.NODE_IP}/{config.NODE_PREFIX}"
    if address not in _run("ip", "-o", "-4", "addr", "show", "dev", config.HOST_LINK).stdout:
        _run("ip", "addr", "add", address, "dev", config.HOST_LINK)
    for name, value in config.NETWORK_SYSCTLS.items():
        write_sysctl(name, value)
    _run("nft", "delete", "table", "inet", config.GUARD_TABLE, check=False)
    _run("nft", "-f", "-", stdin=config.guard_ruleset())


def _hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies (one folder per mounted controller set), not the v2 `unified` mount."""
    return sorted(
        entry
        for entry in CGROUP_BASE.iterdir()
        if entry.is_dir() and not entry.is_symlink() and entry.name != "unified" and (entry / "tasks").exists()
    )


def prepare_cgroups() -> None:
    """The kubelet's cgroup root must exist in every hierarchy; cpuset's needs its parent's CPUs and memory nodes."""
    for hierarchy in _hierarchies():
        root = hierarchy / config.CGROUP_ROOT
        root.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (root / name).exists() and not (root / name).read_text().strip():
                (root / name).write_text((hierarchy / name).read_text())


def _cgroup_dirs() -> list[Path]:
    """Every cgroup under the node's root, deepest first (runc also joins the v2 `unified` mount in hybrid mode)."""
    found: list[Path] = []
    unified = CGROUP_BASE / "unified"
    for hierarchy in [*_hierarchies(), *([unified] if unified.is_dir() else [])]:
        root = hierarchy / config.CGROUP_ROOT
        if root.is_dir():
            found += [Path(d) for d, _, _ in os.walk(root)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _cgroup_pids() -> set[int]:
    pids: set[int] = set()
    for directory in _cgroup_dirs():
        with contextlib.suppress(OSError):
            pids |= {int(line) for line in (directory / "cgroup.procs").read_text().split()}
    return pids


def kill_processes(extra: Iterable[int] = ()) -> int:
    """SIGKILL every process in the node's cgroups (containers, sandboxes) and `extra` (containerd's shims, which
    leave containerd's process group); the count killed."""
    pids = _cgroup_pids() | set(extra)
    pids.discard(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _cgroup_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(pids)


def shim_pids(socket: Path) -> list[int]:
    """containerd's runc shims of this node: they detach into their own sessions, so `procs.stop` misses them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode(errors="replace")).name == "containerd-shim-runc-v2" and str(socket).encode() in (
                b" ".join(argv)
            ):
                found.append(int(entry.name))
    return found


def mounts_under(folders: Iterable[Path], mountinfo: str | None = None) -> list[str]:
    """Mount points at or below any of `folders`, deepest first (from /proc/self/mountinfo)."""
    prefixes = [str(f).rstrip("/") for f in folders]
    points = []
    text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    for line in text.splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_all(folders: Iterable[Path]) -> int:
    points = mounts_under(folders)
    for point in points:
        _run("umount", "--lazy", point, check=False)
    return len(points)


def release(folders: Iterable[Path], pod_logs: Path, progress: Progress) -> None:
    """Undo everything the real node did to the host (its processes must be stopped first, shims included)."""
    folders = list(folders)
    killed = kill_processes()
    if killed:
        progress(f"real node: {killed} container processes killed")
    unmounted = unmount_all(folders)
    if unmounted:
        progress(f"real node: {unmounted} mounts removed")
    # Pods' veths go with their namespaces; any left (a namespace still held) are deleted before the bridge.
    for line in _run("ip", "-o", "link", "show", "master", config.BRIDGE, check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        _run("ip", "link", "delete", name, check=False)
    for link in (config.BRIDGE, config.HOST_LINK):
        if _run("ip", "link", "delete", link, check=False).returncode == 0:
            progress(f"real node: {link} deleted")
    for family, table in NFT_TABLES:
        _run("nft", "delete", "table", family, table, check=False)
    try:
        saved = json.loads(SAVED_FILE.read_text())
    except (OSError, ValueError):
        saved = {"sysctls": {}, "existed": list(FOREIGN_PATHS)}
    for name, value in saved["sysctls"].items():
        with contextlib.suppress(OSError):
            if read_sysctl(name) != value:
                write_sysctl(name, value)
    for directory in _cgroup_dirs():
        with contextlib.suppress(OSError):
            directory.rmdir()
    _remove_log_links(pod_logs)
    for path in FOREIGN_PATHS:
        if path not in saved["existed"] and os.path.lexists(path):
            unmount_all([Path(path)])
            shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    progress("real node: host restored (sysctls, nftables, bridge, mounts, cgroups)")


def _remove_log_links(pod_logs: Path) -> None:
    """The kubelet links each container's log into /var/log/containers; only the links into this node's logs go."""
    links = Path("/var/log/containers")
    if not links.is_dir():
        return
    for link in links.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and str(os.readlink(link)).startswith(str(pod_logs)):
                link.unlink()
