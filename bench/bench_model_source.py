"""Where a model server's model comes from, measured on the real node: an S3 download by the fetch init container
against an OCI image mounted as an image volume (issue 48), cold (the node's first pull of that image) and warm (a
second replica on the same node), side by side in one run.

Each round makes a new chargpt model (new weights, so no layer of it is on the node yet), uploads it to S3 (the
stack's S3 server, relayed onto the node's address) and pushes it to the stack's registry (`loom model push`'s code).
Then, in turn (the order alternates between rounds), an InferenceService with `model.uri: s3://...` and one with
`model.uri: oci://...@sha256:...`, each on the real node: one replica, then a second one. The time from the pod's
creation (the watch's ADDED event) to its server answering ready (asked every 0.1 s on the pod's address) is what
a replica costs to start;
the bytes each replica fetched: the S3 folder's size for every S3 replica (each downloads it), the image's size
from the kubelet's pull event for the cold OCI replica, nothing for the warm one (its event says the image is
already on the machine). The model servers run the development image (this checkout) under the operator (a host
process); both variants load the same files with the same handler.

    LOOM_STATE_DIR=.state/real-node python bench/bench_model_source.py [--rounds 3] [--layers 6 --embd 384]

Needs root and the real node (started here when the stack is not up). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client, watch

from loom.devstack.cluster import Cluster, StackConfig, current, up
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.realnode import config
from loom.devstack.cluster.realnode.images import DEV_IMAGE
from loom.devstack.servers import S3Endpoint, s3_server
from loom.e2e.pytest_operator import apply_crds, operator_namespace_for, operator_process
from loom.e2e.pytest_services import apply_s3_secret
from loom.workloads.common.oci.reference import ImageReference, parse_reference
from loom.workloads.common.oci.registry import Registry
from loom.workloads.common.oci.transfer import push_folder

TIMEOUT_S = 600


def chargpt_folder(folder: Path, seed: int, layers: int, embd: int) -> Path:
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    torch.manual_seed(seed)
    model = chargpt.GPT(chargpt.GPTConfig(block_size=64, n_layer=layers, n_head=4, n_embd=embd))
    return save_for_serving(model, folder)


@contextlib.contextmanager
def relayed(s3: S3Endpoint) -> Iterator[S3Endpoint]:
    """The S3 server (a host process on loopback) relayed onto the node's address, where pods reach it."""
    port = int(s3.url.rsplit(":", 1)[1])
    relay = subprocess.Popen(
        [sys.executable, "-m", "loom.devstack.cluster.realnode.relay",
         f"--listen={config.NODE_IP}:{port}", f"--target=127.0.0.1:{port}"],
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    try:
        on_node = dataclasses.replace(s3, url=f"http://{config.NODE_IP}:{port}")

        def answers() -> bool:
            try:
                return httpx.get(f"{on_node.url}/moto-api/", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answers, timeout=30, what="S3 on the node's address")
        yield on_node
    finally:
        relay.terminate()
        relay.wait(timeout=10)


def service(name: str, model: dict[str, Any], replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": model,
            "handler": "chargpt",
            "replicas": replicas,
            "nodeSelector": config.NODE_SELECTOR,
            "tolerations": [config.TOLERATION],
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"}],
        },
    }


def time_new_pod_to_ready(core: client.CoreV1Api, namespace: str, start: Any) -> tuple[str, float]:
    """Run `start()`, then follow the namespace's pods: the first new pod's name and the seconds from its ADDED event
    to its server answering ready. The server's readiness endpoint is asked directly every 0.1 s once the pod has
    an address (the kubelet's readiness probe runs every 2 s: its Ready condition would round to that)."""
    listed = core.list_namespaced_pod(namespace)
    existing = {p.metadata.name for p in listed.items}
    stream = watch.Watch()
    start()
    added: dict[str, float] = {}
    found: tuple[str, str] | None = None
    try:
        version = listed.metadata.resource_version
        for event in stream.stream(core.list_namespaced_pod, namespace, resource_version=version,
                                   timeout_seconds=TIMEOUT_S):  # fmt: skip
            pod = event["object"]
            name = pod.metadata.name
            if name in existing or pod.metadata.deletion_timestamp:
                continue
            added.setdefault(name, time.monotonic())
            if pod.status.pod_ip:
                found = (name, pod.status.pod_ip)
                break
    finally:
        stream.stop()
    if found is None:
        raise TimeoutError(f"no new pod with an address in {namespace} within {TIMEOUT_S} s")
    name, address = found
    deadline = time.monotonic() + TIMEOUT_S
    with httpx.Client(timeout=1) as http:
        while time.monotonic() < deadline:
            try:
                if http.get(f"http://{address}:8080/v2/health/ready").status_code == 200:
                    return name, time.monotonic() - added[name]
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.1)
    raise TimeoutError(f"pod {name} not ready within {TIMEOUT_S} s")


def pulled_bytes(cluster: Cluster, namespace: str, pod: str, image: ImageReference) -> int:
    """What the kubelet's pull event of the pod says it fetched of the image: its size, or 0 when already present."""
    events = yaml.safe_load(cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                                            f"involvedObject.name={pod}", "-o", "json").stdout)["items"]  # fmt: skip
    for event in events:
        message = event.get("message", "")
        if str(image) in message and "Image size:" in message:
            return int(message.rsplit("Image size:", 1)[1].split()[0])
        if str(image) in message and "already present" in message:
            return 0
    raise ValueError(f"no pull event of {image} for pod {pod}")


def delete_service(cluster: Cluster, core: client.CoreV1Api, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "inferenceservice", name, "-n", namespace, "--wait=true")
    wait_until(lambda: not core.list_namespaced_pod(namespace).items, timeout=120, what="the pods gone", interval=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=384)
    args = parser.parse_args()
    cluster = current() or up(StackConfig(real_node=True))
    assert cluster.registry, "this stack runs no image registry: `loom dev up` again"
    times: dict[str, list[float]] = {"s3 first": [], "s3 second": [], "oci cold": [], "oci warm": []}
    fetched: dict[str, list[int]] = {key: [] for key in times}
    apply_crds(cluster)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-model-source-")))
        s3 = stack.enter_context(relayed(stack.enter_context(s3_server(work / "s3"))))
        op = stack.enter_context(operator_process(cluster, work / "operator.log", {"LOOM_SERVER_IMAGE": DEV_IMAGE}))
        namespace = stack.enter_context(operator_namespace_for(cluster, op))
        api = stack.enter_context(cluster.api_client())
        core = client.CoreV1Api(api)
        apply_s3_secret(cluster, namespace, s3)
        bucket = f"bench-{uuid.uuid4().hex[:6]}"
        s3.client().create_bucket(Bucket=bucket)
        repository = f"bench-{uuid.uuid4().hex[:6]}/chargpt"
        for round_ in range(args.rounds):
            folder = chargpt_folder(work / f"model-{round_}", seed=round_, layers=args.layers, embd=args.embd)
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            for path in folder.iterdir():
                s3.client().upload_file(str(path), bucket, f"r{round_}/{path.name}")
            target = parse_reference(f"{cluster.registry}/{repository}:r{round_}")
            with Registry(target.registry) as registry:
                image = push_folder(folder, target, registry, name="chargpt").image
            sources = {
                "s3": {"uri": f"s3://{bucket}/r{round_}", "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}},
                "oci": {"uri": image.uri},
            }
            for kind in (("s3", "oci") if round_ % 2 == 0 else ("oci", "s3")):
                name = f"{kind}-{round_}"
                first, second = ("s3 first", "s3 second") if kind == "s3" else ("oci cold", "oci warm")

                def apply(replicas: int, name: str = name, model: dict[str, Any] = sources[kind]) -> None:
                    body = service(name, model, replicas)
                    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(body))

                pod, seconds = time_new_pod_to_ready(core, namespace, lambda: apply(1))
                times[first].append(seconds)
                fetched[first].append(size if kind == "s3" else pulled_bytes(cluster, namespace, pod, image))
                pod, seconds = time_new_pod_to_ready(core, namespace, lambda: apply(2))
                times[second].append(seconds)
                fetched[second].append(size if kind == "s3" else pulled_bytes(cluster, namespace, pod, image))
                print(f"round {round_} {kind}: {times[first][-1]:.2f} s, then {times[second][-1]:.2f} s", flush=True)
                delete_service(cluster, core, namespace, name)
    print(f"chargpt {args.layers} layers x {args.embd} wide, {size / 1e6:.1f} MB of files; pod ADDED -> ready on the "
          f"real node, {args.rounds} rounds (median, min-max), bytes fetched per replica:")  # fmt: skip
    baseline = statistics.median(times["s3 first"])
    for key, values in times.items():
        median = statistics.median(values)
        print(f"  {key:10s} {median:6.2f} s ({min(values):.2f}-{max(values):.2f})  x{median / baseline:.2f} of s3 first"
              f"  fetched {statistics.median(fetched[key]) / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
