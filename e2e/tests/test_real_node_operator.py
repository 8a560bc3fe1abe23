"""The chart's operator on the real node, from its real image, pulled from the stack's registry (issues 29 and 32).

The README's "Install on a real cluster" walk on the local stack's real node, as written: `make images` builds
`loom/operator` for real (buildah, its base the real node's development image: the same Debian minbase, made once
per machine), `make images push` pushes it to the stack's registry (plain HTTP on loopback) and prints the flags
that pin it by digest, and `helm install` with those flags puts the operator on the real node, whose containerd
pulls it from that registry. There the kubelet and runc enforce what the chart sets (a non-root user, a read-only
root, no privilege escalation, no capabilities, the probes), the operator reaches the API server through the
`kubernetes` Service and the API server reaches its webhook through the webhook Service's real ClusterIP (kube-
proxy's rules), with the chart's TLS.

The workload images are the real node's development image (devstack/cluster/realnode/checkout.py: the API server
mounts this checkout into its pods), so the operator's own pods run there too: a TrainingJob's two workers train to
Succeeded in pods of their own (rendezvous through the headless Service and cluster DNS) and an InferenceService's
two model servers, on one node and one port, fetch their model from S3 (the test session's, relayed onto the node's
address) and answer on their own addresses and through their Service.
Objects placed elsewhere (kwok) still reconcile. Needs a stack with the real node (`make test-real-node`); the
operator image is built from this checkout at each run (2-7 minutes: pip installs its dependencies).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.build import node_bin_dir
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.realnode import config
from loom.devstack.cluster.realnode.images import DEV_IMAGE, NAMESPACE, dev_archive
from loom.devstack.cluster.realnode.node import CONTAINERD_SOCKET
from loom.devstack.images import WORKLOADS
from loom.devstack.servers import S3Endpoint
from loom.e2e.helm_operator import InClusterOperator, operator_in_cluster, wait_default_service_account
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.readme_install import PUSHED_VALUES, environment, real_node_commands
from loom.e2e.tests.test_admission_webhook import CYCLIC, apply, denied
from loom.e2e.tests.test_helm_install import kubectl_json, training_job, wait_running, worker_pods
from loom.e2e.tests.test_image_registry import manifest as registry_manifest
from loom.e2e.tests.test_inferenceservice import infer_body, manifest, upload_placeholder_model, wait_rolled_out
from loom.e2e.tests.test_real_node import finished_log
from loom.e2e.tests.test_real_node import real_node as real_node  # the fixture
from loom.e2e.tests.test_trainingjob_training import TINY_MODEL, committed_steps, events, wait_finished

pytestmark = [pytest.mark.core, pytest.mark.real_node, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
IMAGES_STATE = REPO / ".state" / "images"  # `make images`' own default: a second run reuses the build
BUILD_TIMEOUT_S = 1500
DEV_REPOSITORY, DEV_TAG = DEV_IMAGE.rsplit(":", 1)
POD_PREFIX = config.POD_CIDR.split(".0.0/")[0] + "."


def make(cluster: Cluster, *args: str, env: dict[str, str], timeout: float) -> str:
    result = subprocess.run(
        ["make", "-C", str(REPO), "--no-print-directory", *args],
        env={**cluster.env, **env}, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"make {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def readme_walk() -> tuple[list[str], list[str]]:
    """The README's real-node walk (its "Install on a real cluster" section): the push and the `helm install`."""
    commands = real_node_commands()
    [push] = [argv for argv in commands if "make" in argv]
    [install] = [argv for argv in commands if argv[:2] == ["helm", "install"]]
    return push, install


@pytest.fixture(scope="module")
def pushed(cluster: Cluster, real_node: Any) -> dict[str, Any]:
    """The README's `make images push` (the operator image, built for real) to the stack's registry, as written but
    for `$LOOM_REGISTRY`, which `loom dev env` sets: the helm values it wrote."""
    assert cluster.registry, "this stack runs no image registry: `loom dev up` again"
    env, command = environment(readme_walk()[0])
    assert env == {"REGISTRY": "$LOOM_REGISTRY/loom", "TLS_VERIFY": "false"} and command[:3] == [
        "make",
        "images",
        "push",
    ]
    registry = f"{cluster.registry}/loom"
    env = {
        **env,
        "REGISTRY": registry,
        "LOOM_IMAGES_STATE": str(IMAGES_STATE),
        "LOOM_IMAGES_BASE_ARCHIVE": str(dev_archive(print)),
    }
    out = make(cluster, *command[1:], env=env, timeout=BUILD_TIMEOUT_S)
    values: dict[str, Any] = json.loads((IMAGES_STATE / "pushed-values.yaml").read_text())
    assert values["image"]["registry"] == registry and f"--set image.digest={values['image']['digest']}" in out
    return values


@pytest.fixture(scope="module")
def operator_on_the_real_node(
    cluster: Cluster, pushed: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InClusterOperator]:
    """The README's `helm install` (release, namespaces and the values file's path adapted), its pod on the real
    node. The test values add the development image for the workloads (only the operator's was built and pushed:
    the others are gigabytes of CUDA torch), and the pushed image values again (they come last)."""
    watched = f"lr{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", watched)
    wait_default_service_account(cluster, watched)
    install = [str(IMAGES_STATE / "pushed-values.yaml") if arg == PUSHED_VALUES else arg for arg in readme_walk()[1]]
    values = {
        "image": pushed["image"],
        "workloadImages": {key: {"repository": DEV_REPOSITORY, "tag": DEV_TAG} for key in WORKLOADS},
    }
    workdir = tmp_path_factory.mktemp("helm")
    try:
        with operator_in_cluster(cluster, [watched], values=values, workdir=workdir, command=install) as op:
            yield op
            cluster.kubectl("delete", "loom", "--all", "-n", watched, "--timeout=60s", check=False)
    finally:
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)


def exec_in(cluster: Cluster, op: InClusterOperator, *command: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("exec", "-n", op.namespace, f"deployment/{op.name}", "--", *command, check=False)


def test_the_operator_image_is_pulled_from_the_stacks_registry_by_digest(
    cluster: Cluster, pushed: dict[str, Any], operator_on_the_real_node: InClusterOperator
) -> None:
    op = operator_on_the_real_node
    pod = op.pod()
    assert pod is not None
    assert pod["spec"]["nodeName"] == config.NODE_NAME
    registry, digest = pushed["image"]["registry"], pushed["image"]["digest"]
    reference = f"{registry}/operator@{digest}"
    [container] = pod["spec"]["containers"]
    assert container["image"] == reference
    # What containerd ran: the image it pulled, by the digest the registry serves for that reference.
    [status] = pod["status"]["containerStatuses"]
    assert status["imageID"] == reference, status
    assert registry_manifest(cluster.registry, reference)[0] == 200
    # The kubelet pulled it (an event of the pod), nothing was imported by hand.
    events = kubectl_json(cluster, "get", "events", "-n", op.namespace, "--field-selector", "reason=Pulled")["items"]
    assert any(e["involvedObject"]["name"] == pod["metadata"]["name"] for e in events), events
    # The pod has an address of its own on the node's bridge.
    assert pod["status"]["podIP"].startswith(POD_PREFIX)


def test_the_runtime_enforces_the_charts_security_settings(
    cluster: Cluster, operator_on_the_real_node: InClusterOperator
) -> None:
    op = operator_on_the_real_node
    pod = op.pod()
    assert pod is not None
    # The chart's user (65532, which the image's passwd does not list), not the image's own (1000), and not root.
    uid = pod["spec"]["securityContext"]["runAsUser"]
    assert uid == 65532 and exec_in(cluster, op, "id", "-u").stdout.strip() == str(uid)
    # Read-only root: even the operator's own install cannot be changed; /tmp (an emptyDir) is writable.
    refused = exec_in(cluster, op, "sh", "-c", "touch /opt/loom/changed")
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
    assert exec_in(cluster, op, "sh", "-c", "touch /tmp/scratch && echo ok").stdout.strip() == "ok"
    # No capabilities and no privilege escalation: the kernel's view of the operator's process (PID 1).
    status = dict(
        line.split(":", 1) for line in exec_in(cluster, op, "cat", "/proc/1/status").stdout.splitlines() if ":" in line
    )
    assert int(status["CapEff"].strip(), 16) == 0 and int(status["CapPrm"].strip(), 16) == 0
    assert status["NoNewPrivs"].strip() == "1"
    # Its probes are the kubelet's: the pod went Ready through them, and the health port answers on the pod's address.
    [container] = pod["spec"]["containers"]
    probe = container["readinessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])  # a named port
    answer = httpx.get(f"http://{pod['status']['podIP']}:{port}{probe['path']}", timeout=10)
    assert answer.status_code == 200


def test_the_api_server_reaches_the_webhook_through_its_service_ip(
    cluster: Cluster, operator_on_the_real_node: InClusterOperator
) -> None:
    op = operator_on_the_real_node
    ns = op.watch[0]
    service = kubectl_json(cluster, "get", "service", f"{op.name}-webhook", "-n", op.namespace)
    assert service["spec"]["clusterIP"].startswith(config.SERVICE_CIDR.split(".0.0/")[0] + ".")
    # failurePolicy Ignore admits anything while the webhook cannot be reached: a refusal proves the path (the
    # Service's endpoints are published a moment after the pod is Ready).
    wait_until(
        lambda: apply(cluster, ns, CYCLIC, "--dry-run=server").returncode != 0,
        timeout=60,
        what="the webhook refusing a cyclic graph",
        interval=1,
    )
    message = denied(apply(cluster, ns, CYCLIC), "inferencegraphs.validate.loom.dev")
    assert message.startswith("spec.nodes[b].steps[0].nodeName: nodes form a cycle: root -> a -> b -> root")


def on_the_real_node(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "nodeSelector": config.NODE_SELECTOR, "tolerations": [config.TOLERATION]}


@pytest.fixture
def s3_on_the_node(s3: S3Endpoint) -> Iterator[S3Endpoint]:
    """The session's S3 server (a host process on loopback) relayed onto the node's address, where pods reach it."""
    port = int(s3.url.rsplit(":", 1)[1])
    relay = subprocess.Popen(
        [sys.executable, "-m", "loom.devstack.cluster.realnode.relay",
         f"--listen={config.NODE_IP}:{port}", f"--target=127.0.0.1:{port}"],
        env={**os.environ, "PYTHONSAFEPATH": "1"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        relayed = dataclasses.replace(s3, url=f"http://{config.NODE_IP}:{port}")

        def answers() -> bool:
            try:
                return httpx.get(f"{relayed.url}/moto-api/", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False  # the relay is not listening yet

        wait_until(answers, timeout=30, what="S3 on the node's address")
        yield relayed
    finally:
        relay.terminate()
        relay.wait(timeout=10)


def kill_container(pod: dict[str, Any]) -> None:
    """SIGKILL the worker's container through containerd, as a crash would end it: its init (torchrun) dies, and with
    it every process of the container's PID namespace; the kubelet records the exit and the pod fails."""
    [status] = pod["status"]["containerStatuses"]
    container_id = status["containerID"].removeprefix("containerd://")
    killed = subprocess.run(
        [str(node_bin_dir() / "ctr"), "--address", str(CONTAINERD_SOCKET), "-n", NAMESPACE,
         "task", "kill", "--signal", "SIGKILL", container_id],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert killed.returncode == 0, killed.stderr


def test_a_trainingjob_survives_a_killed_worker_by_resuming_from_its_s3_checkpoint_on_the_real_node(
    cluster: Cluster, operator_on_the_real_node: InClusterOperator, s3_on_the_node: S3Endpoint, bucket: str
) -> None:
    """The training main path in real containers: two workers meet through the headless Service's DNS names,
    checkpoint to S3 (the session's server, relayed onto the node's address), one worker's container is killed by
    the runtime mid-run, the operator restarts the gang, and the new gang resumes from the last committed checkpoint
    and trains to Succeeded. (The same recovery with MLflow's resume tag and the loss curve's continuity:
    e2e/tests/test_trainingjob_training.py, on the node agent, in make test-all.)"""
    op = operator_on_the_real_node
    ns = op.watch[0]
    apply_s3_secret(cluster, ns, s3_on_the_node)
    job = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task", "args": TINY_MODEL},
            "maxSteps": 60,
            "env": [
                {"name": "OMP_NUM_THREADS", "value": "1"},
                {"name": "AWS_DEFAULT_REGION", "value": s3_on_the_node.region},
            ],
            "workers": on_the_real_node({"replicas": 2}),
            "checkpoint": {
                "uri": f"s3://{bucket}/tiny",
                "endpoint": s3_on_the_node.url,
                "secretRef": {"name": "s3-credentials"},
                "everySteps": 10,
                "keepLast": 2,
            },
            "runPolicy": {"backoffLimit": 2},
        },
    }
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(job))
    # Training speed on the node decides how long the first checkpoint takes: torch's import and the rendezvous
    # (about 20 CPU-seconds a rank), then 10 steps of a model this small.
    wait_until(
        lambda: [s for s in committed_steps(s3_on_the_node, bucket, "tiny") if s >= 10],
        timeout=300,
        what="a committed checkpoint at step >= 10 in S3",
        interval=1,
    )
    pods = worker_pods(cluster, ns, "tiny")
    assert sorted(p["metadata"]["name"] for p in pods) == ["tiny-worker-0", "tiny-worker-1"]
    for pod in pods:
        assert pod["spec"]["nodeName"] == config.NODE_NAME
        assert pod["status"]["podIP"].startswith(POD_PREFIX), pod["status"]
    # Two pods, two addresses: they met through the headless Service's DNS names, not through loopback.
    assert len({p["status"]["podIP"] for p in pods}) == 2
    kill_container(next(p for p in pods if p["metadata"]["name"] == "tiny-worker-1"))

    status = wait_finished(cluster, op, ns, "tiny", timeout=420)  # type: ignore[arg-type]  # duck-typed: log_tail()
    assert status["phase"] == "Succeeded", (status, op.log_tail())
    assert status["progress"]["step"] == 60, status
    assert (status["restarts"], status["failures"]) == (1, 1), status
    assert max(committed_steps(s3_on_the_node, bucket, "tiny")) == 60
    # The new gang's rank 0 resumed from a committed checkpoint (the trainer logs it), not from step 0.
    log = finished_log(cluster, ns, "tiny-worker-0")
    resumed = events(log, "resume")
    assert resumed and resumed[0]["step"] >= 10, log[-3000:]
    assert min(e["step"] for e in events(log, "step")) == resumed[0]["step"] + 1


def test_an_inferenceservice_serves_from_pods_on_the_real_node(
    cluster: Cluster, operator_on_the_real_node: InClusterOperator, s3_on_the_node: S3Endpoint, bucket: str
) -> None:
    op = operator_on_the_real_node
    ns = op.watch[0]
    apply_s3_secret(cluster, ns, s3_on_the_node)
    uri = upload_placeholder_model(s3_on_the_node, bucket, "real-node/v1")
    body = manifest("echo", uri, s3_on_the_node, handler="noop", replicas=2)
    body["spec"] = on_the_real_node({k: v for k, v in body["spec"].items() if k != "nodeSelector"})
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
    isvc = wait_rolled_out(cluster, op, ns, "echo")  # type: ignore[arg-type]  # duck-typed: log_tail()
    assert isvc["status"]["phase"] == "Ready" and isvc["status"]["readyReplicas"] == 2
    pods = kubectl_json(cluster, "get", "pods", "-n", ns, "-l", "loom.dev/inferenceservice=echo")["items"]
    assert len(pods) == 2 and all(p["spec"]["nodeName"] == config.NODE_NAME for p in pods)
    # Two model servers on one node listening on the same port, each in its own network namespace: no clash, and
    # each answers on its own address.
    addresses = {p["status"]["podIP"] for p in pods}
    [port] = {p["spec"]["containers"][0]["ports"][0]["containerPort"] for p in pods}
    assert len(addresses) == 2 and all(a.startswith(POD_PREFIX) for a in addresses)
    for address in addresses:
        direct = httpx.post(f"http://{address}:{port}/v2/models/echo/infer", json=infer_body([[3.0]]), timeout=30)
        assert direct.status_code == 200 and direct.json()["outputs"][0]["data"] == [3.0], direct.text
    # Through the Service's ClusterIP (kube-proxy's rules on this host), as a client in the cluster would call it.
    service = kubectl_json(cluster, "get", "service", "echo", "-n", ns)
    address = service["spec"]["clusterIP"]
    port = service["spec"]["ports"][0]["port"]
    answer = httpx.post(f"http://{address}:{port}/v2/models/echo/infer", json=infer_body([[1.0, 2.0]]), timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [1.0, 2.0]  # the noop handler echoes


def test_objects_placed_elsewhere_still_reconcile(
    cluster: Cluster, operator_on_the_real_node: InClusterOperator
) -> None:
    """A TrainingJob on kwok's simulated GPU nodes: the operator on the real node reconciles it like any other."""
    op = operator_on_the_real_node
    ns = op.watch[0]
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(training_job("gpt")))
    wait_running(cluster, op, ns, "gpt")
    job = kubectl_json(cluster, "get", "trainingjob", "gpt", "-n", ns)
    assert job["status"]["workers"] == {"desired": 2, "ready": 2}
    assert "Traceback" not in op.logs(), op.logs()
