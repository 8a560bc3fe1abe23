"""Only one node agent runs per state dir: a new one makes the old one leave (as on SIGHUP)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from loom.devstack.agent.__main__ import take_over

HOLDER = """
import signal, sys, time
from pathlib import Path
from loom.devstack.agent.__main__ import take_over
signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))
import asyncio
asyncio.run(take_over(Path(sys.argv[1])))
print("holding", flush=True)
time.sleep(60)
"""


def test_a_new_agent_takes_the_state_dir_over(tmp_path: Path) -> None:
    old = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        assert old.stdout is not None and old.stdout.readline().strip() == "holding"
        assert (tmp_path / "agent.lock").read_text() == str(old.pid)
        fd = asyncio.run(take_over(tmp_path, wait_seconds=20))
        assert old.wait(timeout=20) == 0  # it left on SIGHUP, not killed
        assert (tmp_path / "agent.lock").read_text() == str(os.getpid())
        os.close(fd)
    finally:
        old.kill()
        old.wait()
