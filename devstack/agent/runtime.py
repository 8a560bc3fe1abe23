"""One container attempt as a process group: start through the launcher, wait, stop, re-adopt.

Each attempt is recorded in `<container dir>/run.json` (launcher pid and its kernel start time,
so a recycled pid is never mistaken for ours). The launcher writes the command's exit code into
`exit`, which lets a restarted agent learn how an adopted container ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loom.devstack.agent.volumes import Mount

LAUNCHER = Path(__file__).resolve().with_name("launcher.py")


def proc_start_ticks(pid: int) -> int | None:
    """Kernel start time of a live (non-zombie) process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group (zombies excluded)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def parse_exit(text: str) -> tuple[int, str | None]:
    """The launcher's exit file: 'CODE' or 'CODE REASON'."""
    code, _, reason = text.strip().partition(" ")
    return int(code), reason or None


@dataclass
class RunRecord:
    launcher_pid: int
    start_ticks: int
    started_at: str
    log_path: str
    attempt: int


class ContainerProcess:
    """A container's current attempt; the folder keeps run.json, pid and exit files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.record: RunRecord | None = None
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def exit_file(self) -> Path:
        return self.folder / "exit"

    @property
    def pid_file(self) -> Path:
        return self.folder / "pid"

    @property
    def termination_file(self) -> Path:
        return self.folder / "termination-log"

    def termination_message(self) -> str | None:
        """The container's termination message (the kubelet keeps at most 4096 bytes of it)."""
        try:
            text = self.termination_file.read_bytes()[:4096].decode(errors="replace").strip()
        except OSError:
            return None
        return text or None

    async def start(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        mounts: list[Mount],
        hosts_file: str,
        hostname: str,
        log_path: Path,
        attempt: int,
        started_at: str,
        termination_path: str = "/dev/termination-log",
        host_paths: tuple[str, ...] = (),
    ) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in (self.exit_file, self.pid_file):
            stale.unlink(missing_ok=True)
        self.termination_file.write_text("")
        spec: dict[str, Any] = {
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "mounts": [{"source": m.source, "target": m.target, "readOnly": m.read_only} for m in mounts],
            "hostsFile": hosts_file,
            "hostname": hostname,
            # What the container writes at terminationMessagePath becomes state.terminated.message (kubelet does so).
            "terminationLog": {"source": str(self.termination_file), "target": termination_path},
            "hostPaths": list(host_paths),
            "exitFile": str(self.exit_file),
            "pidFile": str(self.pid_file),
        }
        spec_path = self.folder / "spec.json"
        spec_path.write_text(json.dumps(spec))
        os.chmod(spec_path, 0o600)  # env may carry secret values
        log_path.parent.mkdir(parents=True, exist_ok=True)
        launcher_env = {"PYTHONSAFEPATH": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        with open(log_path, "ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                # -S and a file path: the launcher needs only the stdlib, and skipping site-packages
                # (a large virtualenv) makes every container start several times faster.
                sys.executable,
                "-S",
                str(LAUNCHER),
                str(spec_path),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=launcher_env,
                cwd="/",
            )
        ticks = proc_start_ticks(self._proc.pid) or 0
        self.record = RunRecord(self._proc.pid, ticks, started_at, str(log_path), attempt)
        (self.folder / "run.json").write_text(json.dumps(asdict(self.record)))

    def adopt(self) -> bool:
        """Take over an attempt started by an earlier agent, if its launcher still runs."""
        try:
            record = RunRecord(**json.loads((self.folder / "run.json").read_text()))
        except (OSError, ValueError, TypeError):
            return False
        self.record = record
        return proc_start_ticks(record.launcher_pid) == record.start_ticks or self.exit_file.exists()

    def child_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        if self.record is None:
            return False
        return proc_start_ticks(self.record.launcher_pid) == self.record.start_ticks

    async def wait(self) -> tuple[int, str | None]:
        """Wait for the attempt to end; returns (exit code, reason from the launcher or None)."""
        assert self.record is not None
        if self._proc is not None:
            await self._proc.wait()
        else:
            while self.running():
                await asyncio.sleep(0.3)
        self._kill_group(signal.SIGKILL)  # like a runtime: the container ends with its main process
        try:
            return parse_exit(self.exit_file.read_text())
        except (OSError, ValueError):
            return 137, None  # the launcher itself was killed before it could record anything

    def _kill_group(self, sig: int) -> None:
        if self.record is None:
            return
        for pid in group_members(self.record.launcher_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def stop(self, grace_seconds: float) -> None:
        """SIGTERM to the group, SIGKILL whatever is left after the grace period."""
        if self.record is None:
            return
        pgid = self.record.launcher_pid
        self._kill_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while group_members(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        self._kill_group(signal.SIGKILL)
        while group_members(pgid):
            await asyncio.sleep(0.05)
        if self._proc is not None:
            await self._proc.wait()
