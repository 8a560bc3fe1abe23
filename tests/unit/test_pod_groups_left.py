"""`loom dev down` kills what the node agent's containers left running when the agent itself was killed first."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from loom.devstack.cluster.procs import kill_group, pod_groups_left


def container(state: Path, pod: str, launcher_pid: int) -> None:
    folder = state / "pods" / pod / "c" / "main"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"launcher_pid": launcher_pid, "start_ticks": 1}))


def test_groups_of_containers_still_running_are_found_and_killed(tmp_path: Path) -> None:
    # A launcher's group: its own session, and a child in the same group that outlives it.
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 60"], start_new_session=True)
    finished = subprocess.Popen(["true"], start_new_session=True)
    finished.wait()
    try:
        container(tmp_path, "running", leader.pid)
        container(tmp_path, "gone", finished.pid)  # nothing left in its group: not listed
        (tmp_path / "pods" / "broken" / "c" / "main").mkdir(parents=True)
        (tmp_path / "pods" / "broken" / "c" / "main" / "run.json").write_text("{")  # skipped, not fatal
        assert pod_groups_left(tmp_path) == [leader.pid]
        kill_group(leader.pid)
        leader.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pod_groups_left(tmp_path) and time.monotonic() < deadline:  # the child dies with its group
            time.sleep(0.05)
        assert pod_groups_left(tmp_path) == []
    finally:
        if leader.poll() is None:
            leader.kill()
