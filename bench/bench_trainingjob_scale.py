"""How fast does the operator turn many TrainingJobs into pods? (local stack, kwok GPU nodes)

Applies N TrainingJobs (2 workers each) in one `kubectl apply` and measures the time until every worker
pod exists and until every job reports Running. The baseline, measured in the same run on the same
cluster, is the same number of pods created directly by one `kubectl apply` (no operator involved), so
the printed ratio is the operator's overhead, not the machine's speed.

    python bench/bench_trainingjob_scale.py [--jobs 200]

Needs the stack (`loom dev up`, or it is started here). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster import StackConfig, current, up
from loom.devstack.cluster.handle import Cluster
from loom.e2e.pytest_operator import apply_crds, operator_process
from loom.e2e.scale_specs import plain_pod, training_job

WORKERS = 2


def count(cluster: Cluster, namespace: str, kind: str, selector: str | None = None, phase: str | None = None) -> int:
    """Objects of `kind` (in `phase`, when given); jsonpath keeps each poll small even with hundreds of pods."""
    args = ["get", kind, "-n", namespace, "-o", "jsonpath={.items[*].status.phase}"]
    if selector:
        args += ["-l", selector]
    phases = cluster.kubectl(*args, timeout=300).stdout.split()
    if phase is None:
        # A just-created TrainingJob has no status yet: count the objects, not their phases.
        names = cluster.kubectl("get", kind, "-n", namespace, "-o", "name", *(["-l", selector] if selector else []))
        return len(names.stdout.split())
    return sum(1 for p in phases if p == phase)


def wait_count(cluster: Cluster, expected: int, probe: Any, timeout: float = 1800) -> float:
    start = time.monotonic()
    while probe() < expected:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"only {probe()} of {expected} after {timeout}s")
        time.sleep(0.5)
    return time.monotonic()


def apply_all(cluster: Cluster, namespace: str, objects: list[dict[str, Any]]) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump_all(objects, handle)
    start = time.monotonic()
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", handle.name, timeout=900)
    os.unlink(handle.name)
    return start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200)
    args = parser.parse_args()
    cluster = current() or up(StackConfig())
    apply_crds(cluster)
    pods_wanted = args.jobs * WORKERS

    with operator_process(cluster, Path(tempfile.mkdtemp()) / "operator.log", {"LOOM_TRAINING_POLL_S": "10"}) as op:
        baseline_ns, jobs_ns = f"{op.namespace_prefix}-baseline", f"{op.namespace_prefix}-jobs"
        for ns in (baseline_ns, jobs_ns):
            cluster.kubectl("create", "namespace", ns)
            while cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode != 0:
                time.sleep(0.25)
        try:
            start = apply_all(
                cluster, baseline_ns, [plain_pod(f"p-{i}", {"bench": "baseline"}) for i in range(pods_wanted)]
            )
            base_created = wait_count(cluster, pods_wanted, lambda: count(cluster, baseline_ns, "pods")) - start
            base_running = (
                wait_count(cluster, pods_wanted, lambda: count(cluster, baseline_ns, "pods", phase="Running")) - start
            )
            # kwok nodes hold 440 pods in all: the baseline's pods must be gone before the jobs' arrive.
            cluster.kubectl("delete", "pods", "--all", "-n", baseline_ns, "--wait=false")
            while count(cluster, baseline_ns, "pods"):
                time.sleep(0.5)

            start = apply_all(cluster, jobs_ns, [training_job(f"tj-{i}", WORKERS) for i in range(args.jobs)])
            selector = "app.kubernetes.io/component=worker"
            created = wait_count(cluster, pods_wanted, lambda: count(cluster, jobs_ns, "pods", selector)) - start
            running = (
                wait_count(cluster, args.jobs, lambda: count(cluster, jobs_ns, "trainingjobs", phase="Running")) - start
            )
        finally:
            cluster.kubectl("delete", "namespace", jobs_ns, baseline_ns, "--wait=false", check=False)

    print(f"{args.jobs} TrainingJobs x {WORKERS} workers = {pods_wanted} pods on kwok nodes")
    print(
        f"baseline: {pods_wanted} plain pods applied directly: "
        f"all created {base_created:.1f}s, all Running {base_running:.1f}s"
    )
    print(f"operator: all worker pods created {created:.1f}s after apply, all jobs Running {running:.1f}s")
    print(f"ratio pods-created operator/baseline: {created / base_created:.2f}")
    print(f"ratio all-Running operator/baseline: {running / base_running:.2f}")


if __name__ == "__main__":
    main()
