"""The node cache of S3 models on the node agent: an operator with LOOM_MODEL_NODE_CACHE_DIR renders the hostPath
into the fetch step; of two replicas on the node, one downloads the model into the node's cache and the other links
it from there (each fetch step's log says which), and both serve it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess, apply_crds, operator_namespace_for, operator_process
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.tests.test_inferenceservice import manifest, upload_placeholder_model, wait_rolled_out

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def node_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("node-model-cache")


@pytest.fixture(scope="module")
def cache_operator(
    cluster: Cluster, node_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    log = tmp_path_factory.mktemp("loom-operator") / "loom_operator.log"
    with operator_process(cluster, log, {"LOOM_MODEL_NODE_CACHE_DIR": str(node_cache)}) as handle:
        yield handle
    print(f"[loom operator] log: {log}", file=sys.__stderr__)


def test_the_second_replica_on_the_node_links_the_model_from_the_nodes_cache(
    cluster: Cluster, cache_operator: OperatorProcess, s3: S3Endpoint, bucket: str, node_cache: Path
) -> None:
    uri = upload_placeholder_model(s3, bucket, "cached/v1")
    with operator_namespace_for(cluster, cache_operator) as ns:
        apply_s3_secret(cluster, ns, s3)
        body = manifest("cached", uri, s3, handler="noop", replicas=2)
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
        isvc = wait_rolled_out(cluster, cache_operator, ns, "cached")
        assert isvc["status"]["readyReplicas"] == 2

        pods = json.loads(cluster.kubectl(
            "get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=cached", "-o", "json").stdout)["items"]
        assert len(pods) == 2
        volumes = {v["name"]: v for v in pods[0]["spec"]["volumes"]}
        assert volumes["model-node-cache"]["hostPath"]["path"] == str(node_cache)

        def outcomes() -> list[str] | None:
            found = []
            for pod in pods:
                log = cluster.kubectl("logs", "-n", ns, pod["metadata"]["name"], "-c", "fetch-model", check=False)
                if "node cache hit" in log.stdout:
                    found.append("hit")
                elif "node cache miss" in log.stdout:
                    found.append("miss")
            return sorted(found) if len(found) == 2 else None

        assert wait_until(outcomes, timeout=60, what="both fetch steps' logs") == ["hit", "miss"]
        entries = [p for p in node_cache.iterdir() if not p.name.startswith(".")]
        assert len(entries) == 1 and (entries[0] / "weights.txt").read_text() == "weights of cached/v1\n"
