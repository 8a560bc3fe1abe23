"""Where a command's CPU goes, by component: `python bench/cpu_by_component.py -- make test`.

Runs the command, and once a second reads every process's CPU time (user + system, from /proc) and command line;
at the end prints the CPU-seconds of every process started during the run, summed by component (the patterns
below), and the share of the machine's cores they used. A process that lived less than a second is missed, so
the sums are a lower bound. This is how `make test` was found CPU-bound (README, "How make test runs, and its
budget"; docs/measurements.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

HZ = os.sysconf("SC_CLK_TCK")

# First match wins: more specific patterns first.
COMPONENTS = [
    ("mypy, ruff, import-linter", r"mypy|ruff|lint-imports"),
    ("trainer pods (e2e)", r"/etc/loom/trainer|torchrun.*rdzv-endpoint=[a-z]"),
    ("trainer runs (cluster-free)", r"torchrun|loom\.workloads\.trainer|torch\.distributed\.run"),
    ("vLLM engines", r"vllm|EngineCore"),
    ("LLM front", r"loom\.workloads\.llm"),
    ("model servers", r"loom\.workloads\.server"),
    ("router, picker", r"loom\.workloads\.router|picker"),
    ("Feast processes", r"feast|loom\.workloads\.features"),
    ("simulated GPU exporter", r"simgpu"),
    ("operators", r"loom\.operator|loom operator|operator\.cli"),
    ("node agent", r"devstack\.agent"),
    ("kube-apiserver", r"kube-apiserver"),
    ("etcd", r"\betcd\b"),
    ("kube-controller-manager", r"kube-controller-manager"),
    ("kube-scheduler", r"kube-scheduler"),
    ("kubelet, containerd (real node)", r"kubelet|containerd|runc"),
    ("kwok", r"kwok"),
    ("Kueue", r"kueue"),
    ("Prometheus", r"prometheus"),
    ("MLflow", r"mlflow|uvicorn"),
    ("S3 (moto)", r"moto|devstack\.backing"),
    ("kubectl", r"kubectl"),
    ("helm", r"\bhelm\b"),
    ("pytest (e2e workers)", r"pytest.*e2e|exec\(eval\(sys\.stdin"),
    ("pytest (tests/)", r"pytest"),
]


def sample(seen: dict[tuple[int, str], list[object]]) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat.rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ
            key = (int(pid), fields[19])  # pid and start time: a reused pid is another process
            if key not in seen or not seen[key][0]:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                seen[key] = [command, cpu, seen.get(key, [None, 0.0, time.time()])[2]]
            else:
                seen[key][1] = cpu
        except (OSError, IndexError, ValueError):
            continue  # gone between listdir and read


def component(command: str) -> str:
    return next((name for name, pattern in COMPONENTS if re.search(pattern, command)), "other")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="+", help="the command to run (after --)")
    args = parser.parse_args()
    seen: dict[tuple[int, str], list[object]] = {}
    sample(seen)
    before = set(seen)
    started = time.time()
    process = subprocess.Popen(args.command)
    while process.poll() is None:
        sample(seen)
        time.sleep(1)
    wall = time.time() - started
    totals: dict[str, float] = defaultdict(float)
    for key, (command, cpu, _) in seen.items():
        if key not in before:
            totals[component(str(command))] += float(cpu)  # type: ignore[arg-type]
    total = sum(totals.values())
    cores = os.cpu_count() or 1
    print(f"\n{args.command[0]} exited {process.returncode} after {wall:.0f} s: {total:.0f} CPU-seconds sampled, "
          f"{100 * total / (wall * cores):.0f}% of {cores} cores")
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{seconds:8.0f} s {100 * seconds / max(total, 1e-9):5.1f}%  {name}")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
