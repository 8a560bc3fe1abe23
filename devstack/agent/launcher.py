"""Starts one container process in its own mount and UTS namespace and records how it ended.

Run as `python -m loom.devstack.agent.launcher SPEC.json` in a new session (process group). It binds the
pod's volumes and /etc/hosts into a private mount namespace, sets the pod hostname, forks the
command, writes the command's pid, waits, and writes the exit code atomically. Because the exit
code lands in a file, an agent that restarted can re-adopt the container and still learn how it
ended. The launcher stays alive in the same process group, so signalling the group reaches both.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWUTS = 0x00020000, 0x04000000  # os.unshare exists only from Python 3.12
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    rc = _libc.mount(source.encode() if source else None, target.encode(), None, flags, None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def _mount_point(source: str, target: str) -> None:
    """Bind targets must exist and be of the same kind as the source."""
    path = Path(target)
    if os.path.isdir(source):
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def _pinned(path: str) -> tuple[int, str]:
    """An O_PATH handle on `path` and the /proc name that reaches it. Mounting from the handle keeps working
    after an earlier mount of the pod covers the path (a volume at /tmp while the state folder is under /tmp)."""
    fd = os.open(path, os.O_PATH)
    return fd, f"/proc/self/fd/{fd}"


def enter_namespaces(spec: dict[str, Any]) -> None:
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    # Pin every source (inside the new namespace: a bind source must belong to it) before the first mount:
    # once a pod volume covers, say, /tmp, host paths below it are out of sight.
    mounts = [(mount, *_pinned(mount["source"])) for mount in spec["mounts"]]
    hosts = _pinned(spec["hostsFile"])[1] if spec.get("hostsFile") else None
    kept = [(path, _pinned(path)[1]) for path in spec.get("hostPaths", []) if os.path.isdir(path)]
    termination = spec.get("terminationLog")
    termination_source = None
    if termination:
        try:
            termination_source = _pinned(termination["source"])[1]
        except OSError:
            termination = None
    for mount, _, source in mounts:
        _mount_point(source, mount["target"])
        _mount(source, mount["target"], MS_BIND | MS_REC)
        if mount.get("readOnly"):
            _mount(None, mount["target"], MS_BIND | MS_REMOUNT | MS_RDONLY)
    # Host folders the process runs from (venv, checkout, shim) come back on top of any volume covering them.
    targets = [mount["target"].rstrip("/") or "/" for mount, _, _ in mounts]
    for path, source in kept:
        if any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets):
            os.makedirs(path, exist_ok=True)
            _mount(source, path, MS_BIND | MS_REC)
    if hosts:
        _mount(hosts, "/etc/hosts", MS_BIND)
    if termination and termination_source:
        try:
            _mount_point(termination_source, termination["target"])
            _mount(termination_source, termination["target"], MS_BIND)
        except OSError:
            pass  # best effort, as a missing message must not keep a container from starting
    if spec.get("hostname"):
        socket.sethostname(spec["hostname"][:63])


def write_atomic(path: str, text: str, folder_fd: int | None = None) -> None:
    """Write through `folder_fd` (the container's record folder, opened before any mount could hide it)."""
    name = os.path.basename(path) if folder_fd is not None else path
    fd = os.open(name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=folder_fd)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(name + ".tmp", name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    # The pid and exit files live in the agent's state folder, which a pod volume (say at /tmp) may cover.
    records = os.open(os.path.dirname(spec["exitFile"]), os.O_RDONLY | os.O_DIRECTORY)
    try:
        enter_namespaces(spec)
        os.makedirs(spec["cwd"], exist_ok=True)
    except Exception as exc:  # any setup failure must end as a recorded StartError
        print(f"loom-agent: cannot set up the container: {exc}", file=sys.stderr, flush=True)
        write_atomic(spec["exitFile"], "128 StartError", records)
        return 128
    # Ignore nothing by SIG_IGN (that would be inherited across exec): handlers reset on exec.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(spec["cwd"])
            os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
        except OSError as exc:
            print(f"loom-agent: cannot run {spec['argv'][0]!r}: {exc}", file=sys.stderr, flush=True)
            os._exit(127)
    write_atomic(spec["pidFile"], str(pid), records)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as runtimes report
    write_atomic(spec["exitFile"], str(exit_code), records)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
