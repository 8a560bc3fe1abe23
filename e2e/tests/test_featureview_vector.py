"""A vector FeatureView and its embedding service on the real local stack.

An InferenceService serves a tiny Llama (in S3) as an embedding model: the vllm runtime with vLLM's pooling runner
(`extraArgs: --runner=pooling --convert=embed`) behind Loom's front, `/v1/embeddings` with an API key. A FeatureView
whose documents (a parquet in S3) are embedded by that service during materialization is chunked, embedded and
indexed in sqlite-vec by the real Feast Jobs; its status names the index, the model and where to search. A question
embedded by the same service (the official `openai` client) finds the chunk it was taken from through the project's
Feast feature server (`POST /search`), through the Service as a client in the cluster would.

Bad input, each with its cause in the VectorIndex condition: a view whose dimension is not the model's
(DimensionMismatch, naming both numbers) and a view naming an embedding service that is not there
(EmbeddingServiceUnreachable, naming its URL), each in a project of its own. make test-all only: the engine's
start is minutes here.
"""

from __future__ import annotations

import copy
import functools
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pandas as pd
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint
from loom.e2e import objects
from loom.e2e.objects import condition
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret
from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

EMBEDDER, PROJECT = "embedder", "docs"
API_KEY = f"key-{uuid.uuid4().hex}"
TIMEOUT_S = 900.0
DOCUMENTS = {
    "cats": "The cat sat on the mat and purred all afternoon. " * 4,
    "dogs": "Dogs bark at night in the city while people sleep.",
    "rain": "Rain falls on the plain in Spain, mainly in the spring.",
}


wait_for = functools.partial(objects.wait_for, timeout_s=TIMEOUT_S, interval_s=2)


def embedder(bucket: str, s3: S3Endpoint) -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": EMBEDDER},
        "spec": {
            "runtime": "vllm",
            "model": {"uri": f"s3://{bucket}/{EMBEDDER}", "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}},
            "auth": {"apiKeysSecretRef": {"name": "embed-keys", "key": "keys"}},
            "replicas": 1,
            "vllm": {"maxModelLen": 256, "dtype": "float32", "enforceEager": True, "kvCacheMemoryBytes": 64 << 20,
                     "maxNumSeqs": 8, "extraArgs": ["--runner=pooling", "--convert=embed"]},
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}],
        },
    }


def view(name: str, bucket: str, s3: S3Endpoint, dimension: int = 128, service: str = EMBEDDER,
         project: str = PROJECT, server: int = 1) -> dict[str, Any]:
    """A view embedded by `service`. The refused ones have projects of their own and no feature server: views of
    one project applied at the same moment race on its file registry (each pass sees no writer running)."""
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "FeatureView",
        "metadata": {"name": name},
        "spec": {
            "project": project,
            "server": {"replicas": server},
            "entities": [{"name": "chunk_id", "valueType": "String"}],
            "features": [
                {"name": "text", "dtype": "String"},
                {"name": "title", "dtype": "String"},
                {"name": "embedding", "dtype": "Array(Float32)"},
            ],
            "source": {"path": f"s3://{bucket}/documents.parquet", "endpoint": s3.url,
                       "secretRef": {"name": "s3-credentials"}},
            "ttl": "0s",
            "vector": {
                "field": "embedding", "dimension": dimension, "textField": "text",
                "embedding": {"service": service, "model": EMBEDDER, "chunking": {"size": 120, "overlap": 20},
                              "apiKeySecretRef": {"name": "embed-keys", "key": "keys"}},
            },
        },
    }


def test_documents_are_embedded_by_the_service_and_found_through_the_feature_server(
    cluster: Cluster, loom_operator: OperatorProcess, operator_namespace: str, s3: S3Endpoint, bucket: str,
    tmp_path: Path,
) -> None:
    ns, client = operator_namespace, s3.client()
    for path in sorted(write_llama_folder(tmp_path / EMBEDDER, LlamaShape(max_positions=256), seed=1).iterdir()):
        client.upload_file(str(path), bucket, f"{EMBEDDER}/{path.name}")
    pd.DataFrame({
        "document_id": list(DOCUMENTS), "text": list(DOCUMENTS.values()), "title": [d.upper() for d in DOCUMENTS],
        "event_timestamp": [datetime.now(UTC) - timedelta(hours=1)] * len(DOCUMENTS),
    }).to_parquet(tmp_path / "documents.parquet", index=False)
    client.upload_file(str(tmp_path / "documents.parquet"), bucket, "documents.parquet")
    apply_s3_secret(cluster, ns, s3)
    cluster.kubectl("create", "secret", "generic", "embed-keys", "-n", ns, f"--from-literal=keys={API_KEY}")
    objects = [embedder(bucket, s3), view("handbook", bucket, s3),
               view("wrong-dimension", bucket, s3, dimension=64, project="wrong", server=0),
               view("no-service", bucket, s3, service="missing-embedder", project="nowhere", server=0)]
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all(copy.deepcopy(objects)))
    wait_for(cluster, loom_operator, ns, "inferenceservice", EMBEDDER, "Ready",
             lambda o: condition(o, "Ready").get("status") == "True")
    for name in ("handbook", "wrong-dimension", "no-service"):
        cluster.kubectl("annotate", "featureview", name, "-n", ns, f"loom.dev/materialize-now={time.time_ns()}")

    indexed = wait_for(cluster, loom_operator, ns, "featureview", "handbook", "indexed",
                       lambda o: condition(o, "VectorIndex").get("status") in ("True", "False"))
    assert condition(indexed, "VectorIndex")["reason"] == "Indexed", indexed["status"]
    search = indexed["status"]["vectorSearch"]
    assert search["documents"] > len(DOCUMENTS)  # the long document is several chunks
    assert (search["dimension"], search["metric"]) == (128, "cosine")
    # The model identity: the served name and where the InferenceService's model comes from (its spec.model).
    assert search["model"].startswith(f"{EMBEDDER}@") and f"s3://{bucket}/{EMBEDDER}" in search["model"]
    assert search["url"] == f"http://{PROJECT}-features.{ns}.svc"
    assert search["embedding"] == {"service": EMBEDDER, "model": EMBEDDER,
                                   "url": f"http://{EMBEDDER}.{ns}.svc/v1/embeddings"}
    assert search["featureRefs"] == ["handbook:text", "handbook:title"]

    # A question embedded by the same service finds the chunk it was taken from, through the two Services.
    embed = openai.OpenAI(base_url=f"http://{service_address(EMBEDDER, ns, AGENT_STATE_DIR)}:80/v1",
                          api_key=API_KEY, max_retries=0, timeout=120)
    question = DOCUMENTS["dogs"]
    vector = embed.embeddings.create(model=EMBEDDER, input=[question]).data[0].embedding
    server = f"http://{service_address(f'{PROJECT}-features', ns, AGENT_STATE_DIR)}:80"

    def found() -> dict[str, Any] | None:
        answer = httpx.post(f"{server}/search", timeout=30, json={
            "features": search["featureRefs"], "query": vector, "top_k": 2, "api_version": 2})
        if answer.status_code != 200:
            return None
        body = answer.json()
        names = body["metadata"]["feature_names"]
        rows = [dict(zip(names, values, strict=True)) for values in zip(*[r["values"] for r in body["results"]],
                                                                         strict=True)]
        return min(rows, key=lambda row: row["distance"]) if rows else None

    best = wait_until(found, timeout=60, what="the feature server answers /search", interval=2)
    assert (best["chunk_id"], best["title"], best["text"]) == ("dogs#0", "DOGS", question.strip())
    assert best["distance"] == pytest.approx(0.0, abs=1e-3)

    wrong = wait_for(cluster, loom_operator, ns, "featureview", "wrong-dimension", "refused",
                     lambda o: condition(o, "VectorIndex").get("status") == "False")
    cause = condition(wrong, "VectorIndex")
    assert cause["reason"] == "DimensionMismatch", cause
    assert "vector.dimension 64" in cause["message"] and "vectors of 128 dimensions" in cause["message"]

    missing = wait_for(cluster, loom_operator, ns, "featureview", "no-service", "refused",
                       lambda o: condition(o, "VectorIndex").get("status") == "False")
    cause = condition(missing, "VectorIndex")
    assert cause["reason"] == "EmbeddingServiceUnreachable", cause
    assert f"http://missing-embedder.{ns}.svc" in cause["message"]
