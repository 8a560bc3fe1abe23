"""`make chaos`: the chaos suite's scenarios at report scale on the local real stack, each printing its figures
(counts, failures, p50/p99 where there are latencies). Scenarios live in loom.e2e.chaos (registry.py says how to add
one); the e2e tests assert the same invariants at a smaller scale.

    PYTHONSAFEPATH=1 .venv/bin/python bench/chaos.py [--list] [--scale test|report] [SCENARIO ...]

Exit status 1 when any scenario reports a failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from loom.devstack.cluster import StackConfig, current, down, up
from loom.devstack.cluster.lifecycle import join_session, leave_session
from loom.e2e.chaos.registry import Run, load, run_scenarios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", help="names to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--scale", choices=["test", "report"], default="report")
    args = parser.parse_args(argv)
    if args.list:
        for name, entry in load().items():
            print(f"{name}: {entry.about}")
        return 0
    # The stack is shared like an e2e session's: reused when up, started (and stopped by the last one out) if not.
    join_session()
    try:
        cluster = current() or up(StackConfig.from_env(), started_by="pytest")
        with tempfile.TemporaryDirectory(prefix="loom-chaos-") as workdir:
            failures = run_scenarios(args.scenarios, Run(cluster, Path(workdir), args.scale))
    finally:
        if leave_session():
            down()
    print(f"== chaos: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
