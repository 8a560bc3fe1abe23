"""Start, find and stop the stack's processes.

Every component runs in its own session (so its own process group), logs to
<state>/logs/<name>.log and is recorded in <state>/run/<name>.json. Stopping signals the whole
group, so helpers a component spawned go with it. A record is trusted only while the process it
names still runs the recorded executable, so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from loom.devstack.cluster.paths import LOG_DIR, RUN_DIR


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    pid: int
    argv: list[str]
    log: str

    @property
    def record_path(self) -> Path:
        return RUN_DIR / f"{self.name}.json"


def _record_path(name: str) -> Path:
    return RUN_DIR / f"{name}.json"


def log_path(name: str) -> Path:
    return LOG_DIR / f"{name}.log"


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may itself contain spaces.
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _reap(pid: int) -> None:
    """Collect our own exited children, so they do not linger as zombies that look alive."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _runs(record: ProcessRecord) -> bool:
    _reap(record.pid)
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if _is_zombie(record.pid):
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == record.argv[0]


def read_record(name: str) -> ProcessRecord | None:
    try:
        data = json.loads(_record_path(name).read_text())
    except (OSError, ValueError):
        return None
    return ProcessRecord(name=name, pid=int(data["pid"]), argv=list(data["argv"]), log=str(data["log"]))


def running(name: str) -> ProcessRecord | None:
    """The live process recorded under `name`, or None."""
    record = read_record(name)
    return record if record is not None and _runs(record) else None


def start(name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> ProcessRecord:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log = log_path(name)
    with open(log, "ab") as out:
        out.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            # Own session: the component outlives `loom dev up`, and `down` can signal its whole group.
            start_new_session=True,
        )
    record = ProcessRecord(name=name, pid=proc.pid, argv=argv, log=str(log))
    record.record_path.write_text(json.dumps({"pid": proc.pid, "argv": argv, "log": str(log)}))
    return record


def exited_with(name: str) -> str:
    """The end of a component's log, for error messages when it died."""
    try:
        lines = log_path(name).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-25:])


def stop(name: str, grace_seconds: float = 10.0) -> bool:
    """Stop the named component and its process group; True when something was running."""
    record = read_record(name)
    if record is None:
        return False
    was_running = _runs(record)
    if was_running:
        _signal_group(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while _runs(record) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Whatever is left in the group (the leader, or children that ignored SIGTERM) is killed.
        # Only while the recorded leader was ours: a stale record's pid may name a stranger's group.
        _signal_group(record.pid, signal.SIGKILL)
        _reap(record.pid)
    record.record_path.unlink(missing_ok=True)
    return was_running


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def pod_groups_left(agent_state_dir: Path) -> list[int]:
    """Process groups of the node agent's containers that still have a process: each container's launcher leads a
    group of its own (so a pod's processes outlive an agent restart, which adopts them), and an agent killed before
    it stopped its pods (its stop took longer than the grace, under load) leaves them running after `down`.

    A group is named by its launcher's pid in the container's run.json; it counts only while some process is still
    in it (a pid in use as a group id is never given to another process, so the group is still that container's)."""
    recorded = set()
    for path in agent_state_dir.glob("pods/*/c/*/run.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            recorded.add(int(json.loads(path.read_text())["launcher_pid"]))
    alive = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command's closing parenthesis: state, ppid, pgrp.
            pgrp = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
            if pgrp in recorded:
                alive.add(pgrp)
    return sorted(alive)


def kill_group(pgid: int) -> None:
    _signal_group(pgid, signal.SIGKILL)
