"""What does the operator ask of the API server when nothing changes? (local stack, kwok nodes, the audit log)

Creates N objects (TrainingJobs of 2 kwok workers, InferenceServices of 2 kwok replicas, InferenceGraphs calling
them, in turn: loom.e2e.chaos.churn.mixed_objects), waits until they have settled (their status unchanged for a
while), then counts, over a quiet window, every request the operator makes, by verb and resource. The operator runs
as the stack's audited identity (loom-audited-operator), whose requests, and only whose, the API server writes to
its audit log (devstack/cluster/components.py, audit_policy), so the count is the operator's alone, which
`apiserver_request_total` (no user label) cannot give. Watches are counted apart: they are the watch cache at
work, not per-pass reads.

    python bench/bench_steady_requests.py [--objects 50] [--quiet-s 60]
    python bench/bench_steady_requests.py --trainingjobs 1000 --inferenceservices 1000

The second form is the scale figure: that many TrainingJobs and InferenceServices (no graphs), the kwok nodes
raised to hold their 2 pods each for the run (and put back after). Printed besides the requests: the time from
the first create to every object settled, the operator's CPU seconds until then and over the quiet window, and
its peak resident memory (VmHWM).

Needs the stack (`loom dev up`, or it is started here). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from loom.devstack.cluster import StackConfig, current, up
from loom.devstack.cluster.components import kubeconfig_path
from loom.devstack.cluster.nodes import NodeShape, ensure_nodes, wait_nodes_ready
from loom.devstack.cluster.paths import AUDIT_LOG
from loom.e2e.audit import audit_offset, operator_requests, what
from loom.e2e.chaos.churn import (
    _namespace,
    _ready,
    create,
    inference_service,
    loom_objects,
    mixed_objects,
    settled,
    training_job,
)
from loom.e2e.chaos.kwok_only import kwok_only
from loom.e2e.pytest_operator import apply_crds, operator_process
from loom.operator.settings import OperatorSettings


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def peak_memory_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def kwok_room(api: Any, pods: int) -> Iterator[None]:
    """The stack's kwok nodes hold 440 pods; for more, raise their pod capacity for the block, then put it back."""
    default = NodeShape()
    if pods <= default.count * int(default.pods) * 0.9:
        yield
        return
    wait_nodes_ready(api, ensure_nodes(api, NodeShape(pods=str(pods // default.count + 100))), 60)
    try:
        yield
    finally:
        ensure_nodes(api, default)


@contextlib.contextmanager
def reporting(api: Any, namespace: str, pid: int, every_s: float = 60.0) -> Iterator[None]:
    """Print, each `every_s` until the block ends, how many objects are Ready and pods exist, and the operator's CPU
    and memory so far: a run cut short (the 1,000 + 1,000 one takes tens of minutes here) still says how far it got."""
    stop, started, cpu_at_start = threading.Event(), time.monotonic(), cpu_seconds(pid)

    def report() -> None:
        core = client.CoreV1Api(api)
        while not stop.wait(every_s):
            try:
                objects = loom_objects(api, namespace)
                pods = len(core.list_namespaced_pod(namespace, limit=5000).items)
                ready = sum(1 for o in objects.values() if _ready(o))
                print(f"[{time.monotonic() - started:5.0f}s] {ready} of {len(objects)} objects Ready, {pods} pods; "
                      f"operator {cpu_seconds(pid) - cpu_at_start:.0f} CPU-s, peak {peak_memory_mib(pid):.0f} MiB",
                      flush=True)  # fmt: skip
            except Exception as error:  # a report is best effort; the run goes on
                print(f"[report] {type(error).__name__}: {error}", flush=True)

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=50)
    parser.add_argument("--quiet-s", type=float, default=60.0)
    parser.add_argument("--trainingjobs", type=int, help="instead of --objects: this many TrainingJobs ...")
    parser.add_argument("--inferenceservices", type=int, default=0, help="... and this many InferenceServices")
    parser.add_argument("--settle-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    cluster = current() or up(StackConfig())
    apply_crds(cluster)
    workdir = Path(tempfile.mkdtemp())
    # The operator's own defaults where the test harness shortens them (the training poll: 1 s in tests, 5 s here).
    defaults = OperatorSettings.model_fields
    env = {
        "KUBECONFIG": str(kubeconfig_path("audited-operator")),
        "LOOM_TRAINING_POLL_S": str(defaults["training_poll_s"].default),
        "LOOM_NODE_LOST_GRACE_S": str(defaults["node_lost_grace_s"].default),
    }
    prefix = "lsteady"
    if args.trainingjobs is not None:
        objects = [training_job(f"qtj{i}") for i in range(args.trainingjobs)]
        objects += [inference_service(f"qis{i}") for i in range(args.inferenceservices)]
        args.objects = len(objects)
    else:
        objects = mixed_objects(args.objects, "q")
    with (
        cluster.api_client() as api,
        kwok_room(api, 2 * len(objects)),
        _namespace(cluster, prefix) as ns,
        kwok_only(api, ns),
        operator_process(cluster, workdir / "operator.log", env, prefix=prefix) as op,
    ):
        pid = op.process.pid
        cpu_at_start = cpu_seconds(pid)
        started = time.monotonic()
        with reporting(api, ns, pid):
            for obj in objects:
                create(api, ns, obj)
            print(f"[{time.monotonic() - started:5.0f}s] {len(objects)} objects created", flush=True)
            settled(api, ns, [o["metadata"]["name"] for o in objects], quiet_s=10, timeout=args.settle_timeout_s)
        converged_s = time.monotonic() - started
        cpu_to_converge = cpu_seconds(pid) - cpu_at_start
        offset = audit_offset()
        cpu_at_quiet = cpu_seconds(pid)
        time.sleep(args.quiet_s)
        requests = operator_requests(offset)
        cpu_quiet, peak_mib = cpu_seconds(pid) - cpu_at_quiet, peak_memory_mib(pid)
        phases = Counter(str((o.get("status") or {}).get("phase")) for o in loom_objects(api, ns).values())
        print(f"operator log: {op.log}")
    if not AUDIT_LOG.exists():
        raise SystemExit(f"no audit log at {AUDIT_LOG}: the stack's API server predates the audit switch; "
                         "`loom dev up` restarts it with the flags")
    watches = [r for r in requests if r.get("verb") == "watch"]
    per_pass = Counter(what(r) for r in requests if r.get("verb") != "watch")
    minutes = args.quiet_s / 60
    print(f"{args.objects} objects ({dict(Counter(o['kind'] for o in objects))}) settled in {converged_s:.0f}s; "
          f"phases {dict(phases)}")
    print(f"operator: {cpu_to_converge:.1f} CPU seconds from the first create to settled "
          f"({cpu_to_converge / args.objects * 1000:.1f} ms per object), {cpu_quiet:.1f} over the quiet window "
          f"({cpu_quiet / args.quiet_s * 100:.1f}% of a core); peak resident memory {peak_mib:.0f} MiB")
    print(f"quiet window {args.quiet_s:.0f}s: {len(requests)} operator requests "
          f"({len(requests) / args.quiet_s:.2f}/s), of them {len(watches)} watch (re)connections")
    for (verb, resource), n in per_pass.most_common():
        print(f"  {verb:>7} {resource:<32} {n / minutes:>7.0f}/min  ({n / minutes / args.objects:.2f} per minute per "
              f"object of all {args.objects})")


if __name__ == "__main__":
    main()
