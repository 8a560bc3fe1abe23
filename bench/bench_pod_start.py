"""Pod start latency, `kubectl apply` to Running, on the real node and on the node agent, side by side.

The same pod (one container that sleeps) is created N times on each node, in turn (real, agent, real, agent, ...),
one at a time; the time from the create call returning to the watch seeing phase Running is measured. On the real
node the container is the development image's (imported into containerd); the node agent ignores images and runs the
command as a host process.

    LOOM_STATE_DIR=.state/real-node python bench/bench_pod_start.py [--pods 10]

Needs a stack with the real node (`loom dev up --real-node`, or it is started here). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

from kubernetes import client, watch

from loom.devstack.cluster import StackConfig, current, up
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.cluster.realnode import config
from loom.devstack.cluster.realnode.images import DEV_IMAGE


def manifest(name: str, real: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": DEV_IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "600"]}],
    }
    if real:
        spec |= {"nodeSelector": config.NODE_SELECTOR, "tolerations": [config.TOLERATION]}
    else:
        spec |= {"nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def start_latency(core: client.CoreV1Api, namespace: str, real: bool) -> float:
    name = f"{'real' if real else 'agent'}-{uuid.uuid4().hex[:6]}"
    stream = watch.Watch()
    version = core.list_namespaced_pod(namespace).metadata.resource_version
    started = time.monotonic()
    core.create_namespaced_pod(namespace, manifest(name, real))
    try:
        for event in stream.stream(
            core.list_namespaced_pod,
            namespace,
            field_selector=f"metadata.name={name}",
            resource_version=version,
            timeout_seconds=120,
        ):
            if event["object"].status.phase == "Running":
                return time.monotonic() - started
    finally:
        stream.stop()
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    raise TimeoutError(f"pod {name} not Running after 120 s")


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"median {statistics.median(ordered):.2f} s, p90 {p90:.2f} s, min {ordered[0]:.2f} s, max {ordered[-1]:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=10)
    args = parser.parse_args()
    cluster = current() or up(StackConfig(real_node=True))
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        namespace = f"bench-pod-start-{uuid.uuid4().hex[:6]}"
        core.create_namespace({"metadata": {"name": namespace}})
        try:
            wait_until(  # pods are refused until the service-account controller made the namespace's default one
                lambda: core.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items,
                timeout=30,
                what="the default ServiceAccount",
            )
            real: list[float] = []
            agent: list[float] = []
            for _ in range(args.pods):
                real.append(start_latency(core, namespace, real=True))
                agent.append(start_latency(core, namespace, real=False))
        finally:
            core.delete_namespace(namespace)
    print(f"pod start (create -> Running), {args.pods} pods each, one at a time, alternating:")
    print(f"  real node ({config.NODE_NAME}): {summary(real)}")
    print(f"  node agent ({AGENT_NODE_NAME}):  {summary(agent)}")
    print(f"  ratio of medians real/agent: {statistics.median(real) / statistics.median(agent):.2f}")


if __name__ == "__main__":
    main()
