"""Train-to-serve on the real local stack: InferenceServices that follow a TrainingJob, applied together with it,
serve what it produces with no human copy step: one serves the final model and generates text through its
Service, the other rolls out each new checkpoint while the job runs.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

TINY_MODEL = ["nLayer=2", "nEmbd=64", "nHead=4", "blockSize=32"]


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def test_inference_service_serves_what_a_training_job_produced(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint
) -> None:
    ns = operator_namespace
    bucket = f"t2s-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3-credentials"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }
    env = [{"name": "AWS_DEFAULT_REGION", "value": s3.region}, {"name": "OMP_NUM_THREADS", "value": "1"}]
    job = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "gpt"},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task", "args": TINY_MODEL},
            # Long enough for checkpoints to come after the operator's first answer from the trainer: a trainer that
            # starts answering is seen up to 8 s late (progress.py UNANSWERED_MAX_REUSE_S), and 40 or 120 steps, done
            # in a few seconds here, could end before it, leaving the follower nothing to roll out but the final model.
            "maxSteps": 400,
            "env": env,
            "workers": {"replicas": 1, "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}},
            "checkpoint": {
                "uri": f"s3://{bucket}/gpt",
                "endpoint": s3.url,
                "secretRef": {"name": "s3-credentials"},
                "everySteps": 40,
            },
        },
    }
    isvc = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "writer"},
        "spec": {
            # The job's store settings (endpoint, credentials Secret) are taken from the TrainingJob.
            "model": {"fromTrainingJob": {"name": "gpt", "checkpoint": "final"}},
            "handler": "chargpt",
            "replicas": 1,
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": env,
        },
    }
    # A second service follows every new checkpoint while the job runs (noop echoes, so the sharded training
    # checkpoints need no loader): each one is a new model version rolled out without anyone touching it.
    follower = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "follower"},
        "spec": {
            "model": {"fromTrainingJob": {"name": "gpt", "checkpoint": "latest"}},
            "handler": "noop",
            "replicas": 1,
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": env,
            "rollout": {"minReadySeconds": 0},
        },
    }
    manifests = yaml.safe_dump_all([secret, isvc, follower, job])
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=manifests)

    # Until the job has a model, the InferenceService says so and runs nothing.
    def waiting() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", "writer")
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        return obj if conds.get("ModelLoaded", {}).get("reason") in ("WaitingForTrainingJob", "Loaded") else None

    first = wait_until(waiting, timeout=120, what="the InferenceService to report on the TrainingJob", interval=1)
    if first["status"]["phase"] != "Ready":  # the job may already be done on a fast machine
        assert first["status"]["phase"] == "Pending"
        assert not get(cluster, ns, "deployment", "writer")

    def serving(name: str = "writer") -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", name)
        status = obj.get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions", [])}
        done = conds.get("Ready", {}).get("status") == "True" and conds.get("RolledOut", {}).get("status") == "True"
        return obj if done else None

    try:
        obj = wait_until(serving, timeout=700, what="the trained model to be served", interval=2)
    except TimeoutError as error:
        raise AssertionError(
            f"{error}\njob: {json.dumps(get(cluster, ns, 'trainingjob', 'gpt').get('status'), indent=1)}\n"
            f"isvc: {json.dumps(get(cluster, ns, 'inferenceservice', 'writer').get('status'), indent=1)}\n"
            f"{loom_operator.log_tail()}"
        ) from None

    job_status = get(cluster, ns, "trainingjob", "gpt")["status"]
    assert job_status["phase"] == "Succeeded"
    step = job_status["checkpoint"]["step"]
    assert obj["status"]["modelVersion"] == f"final-step-{step}"
    config_map = get(cluster, ns, "configmap", "writer-config")
    assert json.loads(config_map["data"]["server.json"])["storageUri"] == f"s3://{bucket}/gpt/final"

    address = service_address("writer", ns, AGENT_STATE_DIR)
    response = httpx.post(
        f"http://{address}:80/v2/models/writer/generate",
        json={"text_input": "The ", "parameters": {"max_tokens": 24, "temperature": 0}},
        timeout=60,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model_version"] == f"final-step-{step}"
    assert isinstance(answer["text_output"], str) and len(answer["text_output"]) > 0

    # The follower ends on the same final model, after having rolled out checkpoints on the way.
    final = wait_until(lambda: serving("follower"), timeout=300, what="the follower to serve", interval=2)
    assert final["status"]["modelVersion"] == f"final-step-{step}"
    replica_sets = json.loads(
        cluster.kubectl("get", "replicasets", "-n", ns, "-l", "loom.dev/inferenceservice=follower", "-o", "json").stdout
    )["items"]
    assert len(replica_sets) >= 2, "the follower never rolled out a checkpoint before the final model"
    response = httpx.post(
        f"http://{service_address('follower', ns, AGENT_STATE_DIR)}:80/v2/models/follower/infer",
        json={"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
        timeout=30,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model_version"] == f"final-step-{step}"
