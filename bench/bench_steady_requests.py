"""What does the operator ask of the API server when nothing changes? (local stack, kwok nodes, the audit log)

Creates N objects (TrainingJobs of 2 kwok workers, InferenceServices of 2 kwok replicas, InferenceGraphs calling
them, in turn: loom.e2e.chaos.churn.mixed_objects), waits until they have settled (their status unchanged for a
while), then counts, over a quiet window, every request the operator makes, by verb and resource. The operator runs
as the stack's audited identity (loom-audited-operator), whose requests, and only whose, the API server writes to
its audit log (devstack/cluster/components.py, audit_policy), so the count is the operator's alone, which
`apiserver_request_total` (no user label) cannot give. Watches are counted apart: they are the watch cache at
work, not per-pass reads.

    python bench/bench_steady_requests.py [--objects 50] [--quiet-s 60]

Needs the stack (`loom dev up`, or it is started here). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from loom.devstack.cluster import StackConfig, current, up
from loom.devstack.cluster.components import kubeconfig_path
from loom.devstack.cluster.paths import AUDIT_LOG
from loom.e2e.audit import audit_offset, operator_requests, what
from loom.e2e.chaos.churn import _namespace, create, loom_objects, mixed_objects, settled
from loom.e2e.chaos.kwok_only import kwok_only
from loom.e2e.pytest_operator import apply_crds, operator_process
from loom.operator.settings import OperatorSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=50)
    parser.add_argument("--quiet-s", type=float, default=60.0)
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
    objects = mixed_objects(args.objects, "q")
    with (
        cluster.api_client() as api,
        _namespace(cluster, prefix) as ns,
        kwok_only(api, ns),
        operator_process(cluster, workdir / "operator.log", env, prefix=prefix) as op,
    ):
        started = time.monotonic()
        for obj in objects:
            create(api, ns, obj)
        settled(api, ns, [o["metadata"]["name"] for o in objects], quiet_s=10, timeout=900)
        converged_s = time.monotonic() - started
        offset = audit_offset()
        time.sleep(args.quiet_s)
        requests = operator_requests(offset)
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
    print(f"quiet window {args.quiet_s:.0f}s: {len(requests)} operator requests "
          f"({len(requests) / args.quiet_s:.2f}/s), of them {len(watches)} watch (re)connections")
    for (verb, resource), n in per_pass.most_common():
        print(f"  {verb:>7} {resource:<32} {n / minutes:>7.0f}/min  ({n / minutes / args.objects:.2f} per minute per "
              f"object of all {args.objects})")


if __name__ == "__main__":
    main()
