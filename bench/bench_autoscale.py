"""How fast does the builtin autoscaler react, and does it flap? (local stack, real Prometheus, real operator)

1. Reaction: an InferenceService (examples/inferenceservice-autoscale-gpu.yaml, noop handler on CPU) runs one
   replica at 30% GPU utilisation (target 60%), published in dcgm-exporter format by a test-driven exporter pod
   and scraped by the stack's Prometheus. The utilisation jumps to 90% at t0; measured: t0 -> the new replica
   requested (the operator's scale write, from its log) and t0 -> the new replica Ready (status.readyReplicas).
   The operator runs with its default 5 s decision round; Prometheus scrapes every --scrape seconds. Repeated
   --trials times (back to 1 replica in between).
2. Flapping: the utilisation swings around the target (total 90% / 30% on one or two replicas: 2 replicas
   would be right for the high half, 1 for the low half) for a simulated 10 minutes. Time is compressed by
   --compress (k): a 60 s load period, 300 s scale-down window (the HPA default) and 5 s decision round become
   60/k, 300/k and 5/k seconds; the 1 s scrape is not compressed. Counted: scale writes and direction changes
   (up then down or down then up), once with the 300 s window and once with none (what a controller without
   stabilisation would do with the same load).

The reference is the KEDA + HPA default chain: KEDA polls Prometheus every 30 s and the HPA controller syncs
every 15 s, about 45 s from a crossing to a new replica requested (plus the scrape).

    python bench/bench_autoscale.py [--trials 3] [--compress 10] [--scrape 1]

Needs the stack (`loom dev up`, or it is started here). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from loom.devstack.cluster import Cluster, StackConfig, current, up
from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import S3Endpoint, s3_server
from loom.e2e.autoscaling import (
    autoscaled,
    direction_changes,
    example,
    get,
    ready_pods,
    scale_writes,
)
from loom.e2e.exporter import Exporter, local_prometheus
from loom.e2e.pytest_operator import OperatorProcess, apply_crds, operator_namespace_for, operator_process
from loom.e2e.pytest_services import apply_s3_secret

TIMEOUT_S = 180.0
KEDA_HPA_REACTION_S = 30 + 15  # KEDA's default pollingInterval + the HPA controller's default sync period


class Service:
    """One autoscaled InferenceService with its exporter, in a namespace `op` watches."""

    def __init__(self, cluster: Cluster, op: OperatorProcess, namespace: str, s3: S3Endpoint, window_s: int) -> None:
        self.cluster, self.op, self.namespace = cluster, op, namespace
        bucket = f"bench-{namespace}"
        s3.client().create_bucket(Bucket=bucket)
        s3.client().put_object(Bucket=bucket, Key="m/weights.txt", Body=b"weights\n")
        apply_s3_secret(cluster, namespace, s3)
        obj = example(namespace, s3, f"s3://{bucket}/m")
        obj["spec"]["autoscaling"]["scaleDown"] = {"stabilizationWindowSeconds": window_s}
        self.name = obj["metadata"]["name"]
        self.exporter = Exporter(cluster, namespace)
        self.exporter.start()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(obj))
        self.wait(lambda o: (o.get("status") or {}).get("readyReplicas") == 1, "one replica ready")

    def wait(self, check: Callable[[dict[str, Any]], bool], what: str, interval: float = 0.2) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            current = get(self.cluster, self.namespace, self.name)
            return current if check(current) else None

        try:
            return dict(wait_until(probe, timeout=TIMEOUT_S, what=what, interval=interval))
        except TimeoutError:
            print(self.op.log_tail(40))
            raise

    def publish_total(self, total: float) -> float:
        """Spread `total` utilisation over the ready replicas; returns when it was set."""
        pods = ready_pods(self.cluster, self.namespace, self.name)
        return self.exporter.publish({pod: total / len(pods) for pod in pods})


def reaction(cluster: Cluster, s3: S3Endpoint, prometheus_url: str, log: Path, trials: int) -> None:
    env = {"LOOM_PROMETHEUS_URL": prometheus_url}  # every autoscaling setting at its default
    with operator_process(cluster, log, env) as op, operator_namespace_for(cluster, op) as namespace:
        service = Service(cluster, op, namespace, s3, window_s=0)
        requested, ready = [], []
        for trial in range(trials):
            service.publish_total(30)
            service.wait(lambda o: autoscaled(o).get("metricValue") == 30 and o["spec"].get("replicas") in (None, 1),
                         "30% seen on one replica")  # fmt: skip
            before = len(scale_writes(op.log, namespace, service.name))
            crossed = service.publish_total(90)
            service.wait(lambda o: (o.get("status") or {}).get("readyReplicas") == 2, "two replicas ready")
            ready_at = time.time()
            write = scale_writes(op.log, namespace, service.name)[before]
            assert (write.reason, write.after) == ("ScaledUp", 2), write
            requested.append(write.at - crossed)
            ready.append(ready_at - crossed)
            print(f"  trial {trial + 1}: requested {requested[-1]:.2f}s, Ready {ready[-1]:.2f}s after the crossing")
            service.publish_total(10)  # back to one replica (window 0 here)
            service.wait(lambda o: (o.get("status") or {}).get("readyReplicas") == 1 and o["spec"]["replicas"] == 1,
                         "back to one replica")  # fmt: skip
    print(
        f"reaction (default 5 s decision round, {len(requested)} trials): new replica requested "
        f"median {statistics.median(requested):.2f}s (min {min(requested):.2f}, max {max(requested):.2f}); "
        f"Ready median {statistics.median(ready):.2f}s (min {min(ready):.2f}, max {max(ready):.2f})"
    )
    print(f"reference KEDA + HPA defaults: ~{KEDA_HPA_REACTION_S}s to the request (30 s polling + 15 s HPA sync)")


def oscillation(cluster: Cluster, s3: S3Endpoint, prometheus_url: str, log: Path, k: float, window_s: int) -> None:
    """A simulated 10 minutes of load swinging around the target, compressed k times."""
    period, interval, duration = 60 / k, 5 / k, 600 / k
    env = {"LOOM_PROMETHEUS_URL": prometheus_url, "LOOM_AUTOSCALE_INTERVAL_S": f"{interval:g}"}
    with operator_process(cluster, log, env) as op, operator_namespace_for(cluster, op) as namespace:
        window = round(window_s / k)
        service = Service(cluster, op, namespace, s3, window_s=window)
        started = time.time()
        while time.time() - started < duration:
            service.publish_total(90)
            time.sleep(period / 2)  # the load's own rhythm
            service.publish_total(30)
            time.sleep(period / 2)
        writes = [w for w in scale_writes(op.log, namespace, service.name) if w.at >= started]
    print(
        f"oscillation, scale-down window {window_s}s (run: {window}s), 60 s load period (run: {period:g}s), "
        f"10 simulated minutes ({duration:g}s at {k:g}x): {len(writes)} scale writes, "
        f"{direction_changes(writes)} direction changes [{', '.join(f'{w.before}->{w.after}' for w in writes)}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--compress", type=float, default=10.0, help="time compression of the oscillation run")
    parser.add_argument("--scrape", type=float, default=1.0, help="Prometheus scrape interval (s)")
    args = parser.parse_args()
    cluster = current() or up(StackConfig())
    apply_crds(cluster)
    work = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    with s3_server(work / "s3") as s3, local_prometheus(cluster, work / "prometheus", args.scrape) as prometheus:
        print(f"Prometheus scrapes every {args.scrape:g}s; operator logs under {work}")
        reaction(cluster, s3, prometheus.url, work / "reaction.log", args.trials)
        for window in (300, 0):
            oscillation(cluster, s3, prometheus.url, work / f"oscillation-{window}.log", args.compress, window)


if __name__ == "__main__":
    main()
