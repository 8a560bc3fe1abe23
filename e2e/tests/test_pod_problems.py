"""Status names a child pod that cannot start, for every kind, on the local stack (issue 31, defect 2).

The node agent (the local kubelet) reports what a kubelet reports: a container whose Secret is missing waits with
CreateContainerConfigError and the message `secret "<name>" not found`; a container that keeps exiting waits with
CrashLoopBackOff and keeps its last termination; the scheduler marks a pod no node can take Unschedulable with its
message. Each kind's Ready condition (and the condition of the part concerned) must say so within one resync, and
a Warning event must say it once:

- FeatureView: examples/featureview-driver-stats-redis.yaml, unchanged, in a namespace without its Redis Secret
  (the issue's report): its apply Job's pod and its two feature-server pods wait on `redis-connection`.
- TrainingJob: a worker whose checkpoint Secret does not exist.
- InferenceService: a model Secret that does not exist (the fetch-model init container waits), and a server that
  crash-loops (a handler that does not import): LoadFailed with the last termination.
- InferenceGraph: the router reads no Secret, so its case is the other cause: a namespace LimitRange whose default
  CPU request no node offers leaves the router Unschedulable, with the scheduler's message.

The operator is the session's host process (its default 30 s resync); nothing here needs S3 or MLflow, since no
pod gets past the cause under test, except the crash loop's model, which comes from the session's S3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.tests.test_inferenceservice import manifest, upload_placeholder_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# One resync (30 s) plus the agent's and the controllers' own latency, with room for a loaded machine.
TIMEOUT_S = 150.0


def get(cluster: Cluster, ns: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def wait_reason(
    cluster: Cluster, op: OperatorProcess, ns: str, kind: str, name: str, ctype: str, reason: str
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = get(cluster, ns, kind, name)
        return obj if condition(obj, ctype).get("reason") == reason else None

    try:
        return dict(wait_until(check, timeout=TIMEOUT_S, what=f"{kind} {name} {ctype} reason {reason}", interval=2))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, kind, name).get("status"), indent=1)
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\nstatus: {status}\n{pods}\n{op.log_tail(40)}") from None


def warnings(cluster: Cluster, ns: str, name: str, reason: str) -> list[str]:
    out = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name},reason={reason},type=Warning",
        "-o", "json",
    ).stdout  # fmt: skip
    return [str(e["message"]) for e in json.loads(out)["items"]]


def test_featureview_names_the_missing_redis_secret_of_its_jobs_and_servers(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    # The S3 Secret exists (no S3 is reached: nothing gets past the missing Redis Secret); `redis-connection` not.
    keys = ("--from-literal=AWS_ACCESS_KEY_ID=k", "--from-literal=AWS_SECRET_ACCESS_KEY=e2e-not-a-secret")
    cluster.kubectl("create", "secret", "generic", "s3-credentials", "-n", ns, *keys)
    path = EXAMPLES / "featureview-driver-stats-redis.yaml"
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    cluster.kubectl("apply", "-n", ns, "-f", str(path))
    missing = 'secret "redis-connection" not found'
    view = wait_reason(cluster, loom_operator, ns, "featureview", name, "Registered", "CreateContainerConfigError")
    assert missing in condition(view, "Registered")["message"]
    view = wait_reason(cluster, loom_operator, ns, "featureview", name, "ServerReady", "CreateContainerConfigError")
    server = condition(view, "ServerReady")
    assert server["status"] == "False" and missing in server["message"] and "rides-redis-features" in server["message"]
    ready = condition(view, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CreateContainerConfigError")
    assert missing in ready["message"]
    assert view["status"]["feastView"] == "driver_stats_redis"
    features = ("conv_rate", "acc_rate", "avg_daily_trips")
    assert view["status"]["featureRefs"] == [f"driver_stats_redis:{f}" for f in features]
    events = warnings(cluster, ns, name, "CreateContainerConfigError")
    assert events and all(missing in m for m in events)
    assert all("e2e-not-a-secret" not in m for m in events)


def test_trainingjob_names_the_missing_secret_of_a_worker(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    job = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "no-secret"},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
            "maxSteps": 10,
            "workers": {"replicas": 1, "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}},
            "checkpoint": {
                "uri": "s3://nowhere/no-secret",
                "endpoint": "http://127.0.0.1:9",
                "secretRef": {"name": "checkpoint-credentials"},
                "everySteps": 5,
            },
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(job))
    stuck = wait_reason(cluster, loom_operator, ns, "trainingjob", "no-secret", "Ready", "CreateContainerConfigError")
    ready = condition(stuck, "Ready")
    assert ready["status"] == "False"
    assert 'secret "checkpoint-credentials" not found' in ready["message"] and "no-secret-worker-0" in ready["message"]
    assert warnings(cluster, ns, "no-secret", "CreateContainerConfigError")


def test_inferenceservice_names_a_missing_model_secret_and_a_crash_loops_last_termination(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint, bucket: str
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    uri = upload_placeholder_model(s3, bucket, "pod-problems")
    lost = manifest("lost-secret", uri, s3, handler="noop", replicas=1)
    lost["spec"]["model"]["secretRef"] = {"name": "model-credentials"}
    crashing = manifest("crashing", uri, s3, handler="loom_no_such_module:Model", replicas=1)
    for obj in (lost, crashing):
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(obj))

    stuck = wait_reason(
        cluster, loom_operator, ns, "inferenceservice", "lost-secret", "Ready", "CreateContainerConfigError"
    )
    loaded = condition(stuck, "ModelLoaded")
    assert loaded["reason"] == "CreateContainerConfigError"
    assert 'secret "model-credentials" not found' in loaded["message"] and "container fetch-model" in loaded["message"]
    assert warnings(cluster, ns, "lost-secret", "CreateContainerConfigError")

    # The server exits at start: the kubelet's CrashLoopBackOff; the reason stays LoadFailed (the model's code),
    # with the last termination's exit code, so a person sees why without the pod's log.
    def crash_seen() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", "crashing")
        message = condition(obj, "ModelLoaded").get("message", "")
        return obj if "last terminated" in message else None

    try:
        crashed = dict(wait_until(crash_seen, timeout=TIMEOUT_S * 2, what="the crash loop reported", interval=2))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, "inferenceservice", "crashing").get("status"), indent=1)
        raise AssertionError(f"{error}\n{status}\n{loom_operator.log_tail(40)}") from None
    loaded = condition(crashed, "ModelLoaded")
    assert loaded["reason"] == "LoadFailed" and "exit code" in loaded["message"], loaded
    assert condition(crashed, "Ready")["reason"] == "LoadFailed"
    assert s3.secret_key not in json.dumps(crashed["status"])


@pytest.mark.integration
def test_inferencegraph_names_an_unschedulable_router_with_the_schedulers_message(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    # A namespace default no node can meet: every container without its own request asks for 5000 CPUs.
    limits = {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": {"name": "huge-default"},
        "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "5000"}, "default": {"cpu": "5000"}}]},
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(limits))
    graph = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceGraph",
        "metadata": {"name": "no-room"},
        "spec": {"nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceName": "anything"}]}}},
    }
    # The step's service only has to exist for the router to be rendered (at zero replicas it runs nothing).
    service = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "anything"},
        "spec": {"model": {"uri": "s3://nowhere/m"}, "handler": "noop", "replicas": 0},
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([service, graph]))
    stuck = wait_reason(cluster, loom_operator, ns, "inferencegraph", "no-room", "RouterAvailable", "Unschedulable")
    router = condition(stuck, "RouterAvailable")
    assert router["status"] == "False" and "Insufficient cpu" in router["message"], router
    assert "pod no-room" in router["message"]
    ready = condition(stuck, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable") and "Insufficient cpu" in ready["message"]
    assert warnings(cluster, ns, "no-room", "Unschedulable")
