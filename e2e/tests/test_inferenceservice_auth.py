"""API keys and rate limits of an InferenceService: the keys Secret reaches the server as a mounted file (never
through the ConfigMap or the operator), requests without a valid key are refused, and a key over its rate limit
gets 429 with Retry-After.
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

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_api_keys_from_a_secret_and_rate_limits(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint
) -> None:
    ns = operator_namespace
    bucket = f"auth-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    s3.client().put_object(Bucket=bucket, Key="echo/v1/weights.txt", Body=b"weights\n")
    key_a, key_b = f"key-{uuid.uuid4().hex}", f"key-{uuid.uuid4().hex}"
    secrets = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-credentials"},
            "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "echo-keys"},
            "stringData": {"keys": f"# one key per line\n{key_a}\n{key_b}\n"},
        },
    ]
    isvc = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "echo"},
        "spec": {
            "model": {"uri": f"s3://{bucket}/echo/v1", "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}},
            "handler": "noop",
            "replicas": 1,
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}],
            # A slow refill, so that a burst of 3 is what a key gets within this test.
            "auth": {
                "apiKeysSecretRef": {"name": "echo-keys", "key": "keys"},
                "rateLimit": {"requestsPerSecond": 0.01, "burst": 3},
            },
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([*secrets, isvc]))

    def ready() -> dict[str, Any] | None:
        result = cluster.kubectl("get", "inferenceservice", "echo", "-n", ns, "-o", "json", check=False)
        obj = json.loads(result.stdout) if result.returncode == 0 else {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        return obj if conds.get("Ready", {}).get("status") == "True" else None

    try:
        wait_until(ready, timeout=300, what="echo Ready", interval=1)
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\n{pods}\n{loom_operator.log_tail()}") from None

    # The keys travel only as a mounted Secret file.
    config_map = cluster.kubectl("get", "configmap", "echo-config", "-n", ns, "-o", "json").stdout
    deployment = cluster.kubectl("get", "deployment", "echo", "-n", ns, "-o", "json").stdout
    assert key_a not in config_map and key_a not in deployment
    assert json.loads(json.loads(config_map)["data"]["server.json"])["auth"]["apiKeysFile"].endswith("/keys")

    url = f"http://{service_address('echo', ns, AGENT_STATE_DIR)}:80/v2/models/echo/infer"
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    with httpx.Client(trust_env=False, timeout=15) as client:
        assert client.post(url, json=body).status_code == 401
        assert client.post(url, json=body, headers={"Authorization": "Bearer not-a-key"}).status_code == 401
        codes = [
            client.post(url, json=body, headers={"Authorization": f"Bearer {key_a}"}).status_code for _ in range(5)
        ]
        assert codes[:3] == [200, 200, 200]
        assert codes[3:] == [429, 429]
        limited = client.post(url, json=body, headers={"Authorization": f"Bearer {key_a}"})
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        # Limits are per key: the other key still has its burst.
        assert client.post(url, json=body, headers={"x-api-key": key_b}).status_code == 200
