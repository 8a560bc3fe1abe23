"""InferenceGraphs on the real local stack: the operator renders the router (ConfigMap, Deployment, Service), the
node agent runs it and the model servers of real InferenceServices (the noop handler, which echoes its inputs,
its placeholder model fetched from the real S3 server); requests go through the graph's Service, as a client in
the cluster would send them, with an unmodified OIP v2 client (tritonclient) and httpx.

One namespace holds the InferenceServices every test uses: the ones `examples/inferencegraph-*.yaml` name, so
those files are applied exactly as written.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from tritonclient.http import InferenceServerClient, InferInput

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess, operator_namespace_for
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.tests.test_inferenceservice import (
    agent_starts_between,
    condition,
    fresh_client,
    get,
    manifest,
    service_url,
    upload_placeholder_model,
    wait_rolled_out,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SERVICES = ("topic-classifier", "poetry-generator", "prose-generator", "chargpt-current", "chargpt-challenger")
READY_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def graph_namespace(cluster: Cluster, loom_operator: OperatorProcess, s3: S3Endpoint) -> Iterator[str]:
    """A watched namespace with every InferenceService the graphs name, all Ready (noop handler, 1 replica)."""
    with operator_namespace_for(cluster, loom_operator) as ns:
        apply_s3_secret(cluster, ns, s3)
        bucket = f"graphs-{uuid.uuid4().hex[:8]}"
        s3.client().create_bucket(Bucket=bucket)
        uri = upload_placeholder_model(s3, bucket, "echo/v1")
        docs = [manifest(name, uri, s3, handler="noop", replicas=1) for name in SERVICES]
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all(docs))
        for name in SERVICES:
            wait_rolled_out(cluster, loom_operator, ns, name)
        yield ns


def apply_graph(cluster: Cluster, ns: str, body: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))


def wait_graph_ready(cluster: Cluster, op: OperatorProcess, ns: str, name: str) -> dict[str, Any]:
    """The graph's current generation is Ready (router available, Hard dependencies Ready)."""

    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferencegraph", name)
        if obj is None:
            return None
        ready = condition(obj, "Ready")
        ok = ready.get("status") == "True" and ready.get("observedGeneration") == obj["metadata"]["generation"]
        return obj if ok else None

    try:
        return dict(wait_until(done, timeout=READY_TIMEOUT_S, what=f"graph {name} Ready", interval=1))
    except TimeoutError as error:
        obj = get(cluster, ns, "inferencegraph", name)
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(
            f"{error}\nstatus: {json.dumps((obj or {}).get('status'), indent=1)}\n{pods}\n{op.log_tail()}"
        ) from None


def graph(name: str, nodes: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceGraph", "metadata": {"name": name},
            "spec": {"nodes": nodes, "router": {"timeoutMs": 5000}}}  # fmt: skip


def topic(text: str, **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "topic", "shape": [1], "datatype": "BYTES", "data": [text]}], **extra}


def client() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=15)


def deployment_generations(cluster: Cluster, ns: str) -> dict[str, int]:
    return {name: int((get(cluster, ns, "deployment", name) or {})["metadata"]["generation"]) for name in SERVICES}


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.core
def test_sequence_through_the_graph_service_with_an_oip_client(
    cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str
) -> None:
    ns = graph_namespace
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"name": "first", "serviceName": "topic-classifier", "dependency": "Hard"},
        {"name": "second", "serviceName": "prose-generator", "data": "$response", "dependency": "Hard"},
    ]}}  # fmt: skip
    apply_graph(cluster, ns, graph("pipeline", nodes))
    obj = wait_graph_ready(cluster, loom_operator, ns, "pipeline")

    status = obj["status"]
    assert status["phase"] == "Ready"
    assert status["url"] == f"http://pipeline.{ns}.svc"
    assert status["services"] == "2/2" and status["readyReplicas"] == 1
    (root,) = status["nodes"]
    assert root["ready"] is True and [s["name"] for s in root["steps"]] == ["first", "second"]
    # The router's children are owned by the graph; its config names the services' in-cluster URLs.
    config_map = get(cluster, ns, "configmap", "pipeline-router-config")
    assert config_map is not None and get(cluster, ns, "deployment", "pipeline-router") is not None
    config = json.loads(config_map["data"]["router.json"])
    assert config["services"]["prose-generator"] == {"url": f"http://prose-generator.{ns}.svc:80",
                                                     "modelName": "prose-generator"}  # fmt: skip
    table = cluster.kubectl("get", "lig", "pipeline", "-n", ns).stdout
    assert "Ready" in table and f"http://pipeline.{ns}.svc" in table and "2/2" in table

    # An unmodified OIP v2 client calls the graph as it calls one model.
    url = service_url(ns, "pipeline")
    triton = InferenceServerClient(url=url.removeprefix("http://"))
    try:
        assert triton.is_server_ready()
        assert triton.get_model_metadata("pipeline")["name"] == "pipeline"
        values = np.arange(6, dtype=np.float32).reshape(2, 3)
        tensor = InferInput("x", [2, 3], "FP32")
        tensor.set_data_from_numpy(values, binary_data=False)
        result = triton.infer("pipeline", [tensor])
        np.testing.assert_array_equal(result.as_numpy("x"), values)
        assert result.get_response()["model_name"] == "prose-generator"  # the last step answered
    finally:
        triton.close()
    with client() as http:
        response = http.post(f"{url}/v2/models/pipeline/infer", json=topic("hello"))
    assert response.status_code == 200, response.text
    assert response.headers["loom-graph-steps"] == "root.first=ok,root.second=ok"


def test_switch_routes_by_a_request_field_and_a_graph_change_rolls_only_the_router(
    cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str
) -> None:
    ns = graph_namespace
    nodes = {"root": {"routerType": "Switch", "steps": [
        {"serviceName": "poetry-generator", "condition": "request.parameters.style == 'poetry'"},
        {"serviceName": "prose-generator", "condition": "request.parameters.style == 'prose'"},
    ]}}  # fmt: skip
    apply_graph(cluster, ns, graph("by-style", nodes))
    wait_graph_ready(cluster, loom_operator, ns, "by-style")
    url = f"{service_url(ns, 'by-style')}/v2/models/by-style/infer"
    with client() as http:
        for style in ("poetry", "prose"):
            response = http.post(url, json=topic("x", parameters={"style": style}))
            assert response.status_code == 200, response.text
            assert response.json()["model_name"] == f"{style}-generator"
        # No branch holds: a structured 404, never a pass-through.
        response = http.post(url, json=topic("x", parameters={"style": "haiku"}))
    assert response.status_code == 404, response.text
    assert (response.json()["code"], response.json()["node"]) == ("no_route", "root")

    # A graph change under steady load: the router rolls (maxUnavailable 0), the model servers are not touched.
    before = deployment_generations(cluster, ns)
    router_before = get(cluster, ns, "deployment", "by-style-router")
    assert router_before is not None
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:
        # A new connection per request, as in the InferenceService rollout test: an idle keep-alive connection
        # that the old router closes on its way out races with the next request on it (any HTTP server's
        # rollout has that race; a client that reuses connections retries it).
        with fresh_client() as http:
            while not stop.is_set():
                try:
                    answer = http.post(url, json=topic("x", parameters={"style": "poetry"}))
                    if answer.status_code == 200:
                        outcomes[answer.json()["model_name"]] += 1
                    else:
                        failures.append(f"HTTP {answer.status_code}: {answer.text[:200]}")
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.02)

    started = time.time()
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        wait_until(lambda: sum(outcomes.values()) >= 20, timeout=60, what="load flowing")
        swapped = [dict(nodes["root"]["steps"][0], serviceName="prose-generator"), nodes["root"]["steps"][1]]
        patch = {"spec": {"nodes": {"root": {"routerType": "Switch", "steps": swapped}}}}
        cluster.kubectl("patch", "inferencegraph", "by-style", "-n", ns, "--type", "merge", "-p", json.dumps(patch))
        wait_graph_ready(cluster, loom_operator, ns, "by-style")
        wait_until(lambda: outcomes["prose-generator"] >= 20, timeout=120, what="the new graph answering")
    finally:
        stop.set()
        worker.join(timeout=30)
    assert failures == [], (
        f"{len(failures)} failed requests, e.g. {failures[:5]}; "
        f"node agent (re)started during the load: {agent_starts_between(started, time.time()) or 'no'}"
    )
    assert outcomes["poetry-generator"] >= 20
    router_after = get(cluster, ns, "deployment", "by-style-router")
    assert router_after is not None
    hash_key = "loom.dev/config-hash"
    assert (
        router_after["spec"]["template"]["metadata"]["annotations"][hash_key]
        != router_before["spec"]["template"]["metadata"]["annotations"][hash_key]
    )
    assert deployment_generations(cluster, ns) == before


def test_a_failing_hard_step_is_a_structured_error_naming_the_step(
    cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str
) -> None:
    ns = graph_namespace
    # Asking for an output the echo model does not have makes every step answer 400: the Soft one is skipped,
    # the Hard one fails the graph.
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"name": "optional", "serviceName": "topic-classifier", "dependency": "Soft"},
        {"name": "required", "serviceName": "prose-generator", "dependency": "Hard"},
    ]}}  # fmt: skip
    apply_graph(cluster, ns, graph("strict", nodes))
    wait_graph_ready(cluster, loom_operator, ns, "strict")
    with client() as http:
        response = http.post(
            f"{service_url(ns, 'strict')}/v2/models/strict/infer", json=topic("x", outputs=[{"name": "missing"}])
        )
    assert response.status_code == 400, response.text
    error = response.json()
    assert (error["code"], error["graph"], error["node"]) == ("upstream_error", "strict", "root")
    assert error["step"] == "required"
    assert (error["service"], error["upstream_status"]) == ("prose-generator", 400)
    assert "missing" in error["upstream_message"]
    assert [(s["step"], s["outcome"]) for s in error["steps"]] == [("optional", "skipped"), ("required", "failed")]


def test_a_graph_problem_admission_cannot_see_is_a_condition(
    cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str
) -> None:
    ns = graph_namespace
    nodes = {
        "root": {"routerType": "Switch", "steps": [{"serviceName": "prose-generator", "condition": "reqest.x == 1"}]},
    }
    apply_graph(cluster, ns, graph("typo", nodes))

    def invalid() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferencegraph", "typo")
        return obj if obj and condition(obj, "GraphValid").get("reason") == "InvalidGraph" else None

    obj = wait_until(invalid, timeout=60, what="GraphValid=False on graph typo")
    assert "unknown variable(s) reqest" in condition(obj, "GraphValid")["message"]
    assert obj["status"]["phase"] == "Failed"
    assert get(cluster, ns, "deployment", "typo-router") is None  # nothing rendered, no crash loop


def test_examples_as_written(cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str) -> None:
    ns = graph_namespace
    for path in sorted(EXAMPLES.glob("inferencegraph-*.yaml")):
        cluster.kubectl("apply", "-n", ns, "-f", str(path))
    wait_graph_ready(cluster, loom_operator, ns, "routed-generation")
    wait_graph_ready(cluster, loom_operator, ns, "ab-test")

    with client() as http:
        # The classifier's answer picks the generator, which gets the original request.
        url = f"{service_url(ns, 'routed-generation')}/v2/models/routed-generation/infer"
        for style, generator in (("poetry", "poetry-generator"), ("news", "prose-generator")):
            response = http.post(url, json=topic(style))
            assert response.status_code == 200, response.text
            assert response.json()["model_name"] == generator
            assert response.json()["outputs"][0]["data"] == [style]

        # The Splitter's observed split over 1,000 requests is within 5 standard deviations of 80/20.
        url = f"{service_url(ns, 'ab-test')}/v2/models/ab-test/infer"
        served: Counter[str] = Counter()
        for _ in range(1000):
            response = http.post(url, json=topic("x"))
            assert response.status_code == 200, response.text
            served[response.json()["model_name"]] += 1
    assert set(served) == {"chargpt-current", "chargpt-challenger"}
    sd = (1000 * 0.2 * 0.8) ** 0.5
    assert abs(served["chargpt-challenger"] - 200) <= 5 * sd, served


def test_ensemble_combines_outputs_by_step_name(
    cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str
) -> None:
    ns = graph_namespace
    nodes = {"root": {"routerType": "Ensemble", "steps": [
        {"name": "current", "serviceName": "chargpt-current", "dependency": "Hard"},
        {"name": "challenger", "serviceName": "chargpt-challenger", "dependency": "Hard"},
    ]}}  # fmt: skip
    apply_graph(cluster, ns, graph("both", nodes))
    wait_graph_ready(cluster, loom_operator, ns, "both")
    with client() as http:
        response = http.post(f"{service_url(ns, 'both')}/v2/models/both/infer", json=topic("hi"))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model_name"] == "both"
    outputs = [(o["name"], o["data"]) for o in answer["outputs"]]
    assert outputs == [("current/topic", ["hi"]), ("challenger/topic", ["hi"])]


def test_generation_streams_through_a_sequence_event_by_event(
    cluster: Cluster, loom_operator: OperatorProcess, graph_namespace: str, s3: S3Endpoint, tmp_path: Path
) -> None:
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    ns = graph_namespace
    torch.manual_seed(0)
    folder = save_for_serving(chargpt.GPT(chargpt.GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)), tmp_path)
    bucket = f"gpt-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    for path in folder.iterdir():
        s3.client().put_object(Bucket=bucket, Key=f"tiny/{path.name}", Body=path.read_bytes())
    body = manifest("tiny-gpt", f"s3://{bucket}/tiny", s3, handler="chargpt", replicas=1)
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
    wait_rolled_out(cluster, loom_operator, ns, "tiny-gpt")
    # The draft is generated whole; its text feeds the last step, whose stream is passed on as it arrives.
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"name": "draft", "serviceName": "tiny-gpt", "dependency": "Hard"},
        {"name": "final", "serviceName": "tiny-gpt", "data": "$response", "dependency": "Hard"},
    ]}}  # fmt: skip
    apply_graph(cluster, ns, graph("story", nodes))
    wait_graph_ready(cluster, loom_operator, ns, "story")

    request = {"text_input": "To be", "parameters": {"max_tokens": 24, "temperature": 0}}
    url = f"{service_url(ns, 'story')}/v2/models/story/generate_stream"
    with client() as http, http.stream("POST", url, json=request) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read()
    # One event per token. How many network chunks carry them depends on how busy the machine is (a tiny model
    # can finish before the router reads its first bytes), so that events are passed on before the stream ends is
    # proven with a gated upstream in tests/unit/test_router_http.py, not counted here.
    events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
    assert len(events) > 1, events
    assert all("error" not in e and e["model_name"] == "tiny-gpt" for e in events), events
    assert len("".join(e["text_output"] for e in events)) == 24
