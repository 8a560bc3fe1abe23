"""spec.routing.pickerReplicas: a standby picker, against the real API server.

- The operator's render (kwok: no pod runs): two picker pods, the Lease created and owned by the service, and the
  picker's ServiceAccount allowed exactly get and update on that one Lease (asked of the API server's own RBAC).
- Failover with real picker processes (their pod's command, over fixed stand-in replicas, the kubeconfig in place
  of the ServiceAccount) electing over a real Lease: one is ready (HTTP /readyz, gRPC health `readiness`), the
  other live but standing by; the leader stopped (SIGTERM) frees the Lease and the standby serves; a leader killed
  outright (SIGKILL: no release) is replaced once its Lease's duration has passed.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import free_port
from loom.e2e.pytest_operator import OperatorProcess
from loom.workloads.picker.config import LeaderElectionConfig, PickerConfig
from loom.workloads.server.testing import child_env

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]

LEASE = "chat-picker"


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def test_two_picker_pods_a_lease_and_a_role_narrowed_to_it(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns, name = operator_namespace, f"standby-{uuid.uuid4().hex[:6]}"
    service = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
               "spec": {"runtime": "vllm", "model": {"uri": f"s3://models/{name}/v1"}, "replicas": 2,
                        "routing": {"pickerReplicas": 2}}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(service))
    picker = wait_until(lambda: get(cluster, ns, "deployment", f"{name}-picker"), timeout=120,
                        what="the picker's Deployment")
    assert picker["spec"]["replicas"] == 2
    assert picker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "100%", "maxUnavailable": "100%"}
    lease = wait_until(lambda: get(cluster, ns, "lease", f"{name}-picker"), timeout=60, what="the Lease")
    isvc = get(cluster, ns, "inferenceservice", name)
    assert lease["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    account = f"system:serviceaccount:{ns}:{name}-picker"

    def can(*args: str) -> bool:
        answer = cluster.kubectl("auth", "can-i", *args, "-n", ns, f"--as={account}", check=False)
        return answer.stdout.strip() == "yes"

    assert can("get", f"leases/{name}-picker") and can("update", f"leases/{name}-picker")
    assert not can("update", "leases/someone-elses") and not can("create", "leases")
    assert not can("delete", f"leases/{name}-picker")


@dataclass
class Picker:
    process: subprocess.Popen[bytes]
    admin: str
    grpc: str


@contextlib.contextmanager
def picker(namespace: str, identity: str, folder: Path, kubeconfig: Path) -> Iterator[Picker]:
    """`python -m loom.workloads.picker` electing over the Lease as pod `identity` (stopped with SIGTERM at the
    end if still running)."""
    config = PickerConfig(
        namespace=namespace, service="chat", pod_selector={"app": "chat"}, host="127.0.0.1", port=free_port(),
        admin_port=free_port(), ext_proc_port=free_port(),
        # Short, so the test's failover takes seconds: a standby takes over 3 s after the last renewal it saw.
        leader_election=LeaderElectionConfig(lease_name=LEASE, duration_seconds=3, renew_deadline_seconds=2,
                                             retry_seconds=0.3))
    path = folder / f"picker-{identity}.json"
    path.write_text(config.to_json())
    argv = [sys.executable, "-m", "loom.workloads.picker", "--config", str(path), "--endpoints", "127.0.0.1:9"]
    with open(folder / f"picker-{identity}.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env=child_env({"KUBECONFIG": str(kubeconfig), "POD_NAME": identity}))
    found = Picker(process, f"http://127.0.0.1:{config.admin_port}", f"127.0.0.1:{config.ext_proc_port}")
    try:
        wait_until(lambda: live(found), timeout=60, what=f"picker {identity} live")
        yield found
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)


def live(found: Picker) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{found.admin}/healthz", timeout=2).status_code == 200
    return False


def ready(found: Picker) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{found.admin}/readyz", timeout=2).status_code == 200
    return False


def health(found: Picker, service: str) -> int:
    with grpc.insecure_channel(found.grpc) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)


def holder(kube_api: client.ApiClient, namespace: str) -> str:
    spec = client.CoordinationV1Api(kube_api).read_namespaced_lease(LEASE, namespace).spec
    return str(spec.holder_identity or "")


def test_the_standby_takes_over_when_the_leader_stops_or_dies(
    cluster: Cluster, kube_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    # The Lease as the operator applies it: empty, the pods write the rest.
    client.CoordinationV1Api(kube_api).create_namespaced_lease(
        namespace, client.V1Lease(metadata=client.V1ObjectMeta(name=LEASE)))
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with picker(namespace, "picker-a", tmp_path, cluster.kubeconfig) as a:
        wait_until(lambda: ready(a), timeout=30, what="a, alone, leading")
        with picker(namespace, "picker-b", tmp_path, cluster.kubeconfig) as b:
            assert holder(kube_api, namespace) == "picker-a"
            assert not ready(b) and live(b)
            assert (health(a, "readiness"), health(b, "readiness")) == (serving, not_serving)
            assert (health(a, "liveness"), health(b, "liveness")) == (serving, serving)
            assert health(b, "inference-extension") == not_serving  # GIE's probe name too

            a.process.send_signal(signal.SIGTERM)  # a rollout or a scale-down: a frees the Lease on its way out
            wait_until(lambda: ready(b), timeout=30, what="b leading after a stopped")
            a.process.wait(timeout=30)
            # Taken over because a freed it, not because it expired (b might have waited that out as well).
            assert f"Lease {LEASE} released" in (tmp_path / "picker-picker-a.log").read_text()
            assert holder(kube_api, namespace) == "picker-b"
            assert health(b, "readiness") == serving

            with picker(namespace, "picker-c", tmp_path, cluster.kubeconfig) as c:
                assert not ready(c)
                b.process.kill()  # its node gone: nothing released; c waits out the Lease's duration
                b.process.wait(timeout=30)
                wait_until(lambda: ready(c), timeout=30, what="c leading after b died")
                assert holder(kube_api, namespace) == "picker-c"
                lease = client.CoordinationV1Api(kube_api).read_namespaced_lease(LEASE, namespace)
                assert lease.spec.lease_transitions == 3  # a, b, c: one term each
