"""Inference enriched with online features, on the real local stack: the two example files applied unchanged
(examples/featureview-driver-stats.yaml and examples/inferenceservice-feature-enriched.yaml) next to what
`loom dev up` provides (S3 as minio.storage.svc, the Secret s3-credentials). The operator (a subprocess) renders
the Feast pods and the model server; the node agent runs Feast and the server for real; the server calls Feast's
feature server through its Service for every request.

One module-scoped setup (Feast's import costs ~25 s per pod): both objects applied at once (the InferenceService
waits for the FeatureView to be Ready), one materialization by annotation, then the checks.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack import backing
from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.e2e import objects
from loom.e2e.objects import condition, get
from loom.e2e.pytest_operator import OperatorProcess, operator_namespace_for
from loom.workloads.features import example_data
from loom.workloads.server.tabular import EXAMPLE_MODEL, MODEL_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VIEW_FILE, SERVICE_FILE = "featureview-driver-stats.yaml", "inferenceservice-feature-enriched.yaml"
VIEW, SERVICE = "driver-stats", "driver-ranker"
TIMEOUT_S = 300.0
FEATURES = ("conv_rate", "acc_rate", "avg_daily_trips")


wait_for = functools.partial(objects.wait_for, timeout_s=TIMEOUT_S, interval_s=1)


class Enriched:
    def __init__(self, cluster: Cluster, op: OperatorProcess, namespace: str, end: Any, waiting: dict[str, Any]):
        self.cluster, self.op, self.namespace, self.end = cluster, op, namespace, end
        self.waiting = waiting  # the InferenceService's Ready condition while the FeatureView was not Ready
        self.url = f"http://{service_address(SERVICE, namespace, AGENT_STATE_DIR)}:80"

    def infer(self, drivers: list[int]) -> httpx.Response:
        body = {"inputs": [{"name": "driver_id", "datatype": "INT64", "shape": [len(drivers)], "data": drivers}]}
        with httpx.Client(trust_env=False, timeout=60) as client:
            return client.post(f"{self.url}/v2/models/{SERVICE}/infer", json=body)


@pytest.fixture(scope="module")
def enriched(cluster: Cluster, loom_operator: OperatorProcess) -> Iterator[Enriched]:
    started = time.monotonic()
    services = backing.ensure(cluster, progress=lambda line: print(f"[enrichment] {line}"))
    # What `loom dev up` seeds at start-up, written again: a stack up for more than the view's 24 h ttl would
    # otherwise serve nothing, and one started before the example existed lacks its model.
    end = example_data.parse_end("now")
    s3 = services.s3_client()
    with tempfile.TemporaryDirectory() as folder:
        written = example_data.write(Path(folder), end)
        s3.upload_file(str(written["driverStats"]), backing.FEATURES_BUCKET, "driver_stats.parquet")
    key = f"{backing.EXAMPLE_MODEL_PREFIX}/{MODEL_FILE}"
    s3.put_object(Bucket=backing.MODELS_BUCKET, Key=key, Body=json.dumps(EXAMPLE_MODEL).encode())
    with operator_namespace_for(cluster, loom_operator) as ns:
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(backing.credentials_secret(ns)))
        cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / VIEW_FILE), "-f", str(EXAMPLES / SERVICE_FILE))
        cluster.kubectl("annotate", "featureview", VIEW, "-n", ns, f"loom.dev/materialize-now={time.time_ns()}")
        # Feast's import alone keeps the view from Ready for ~25 s: the service waits, saying why.
        waiting = condition(
            wait_for(
                cluster, loom_operator, ns, "inferenceservice", SERVICE, "waiting for the FeatureView",
                lambda o: condition(o, "Ready").get("reason") in ("FeatureViewNotFound", "FeatureViewNotReady"),
            ),
            "Ready",
        )  # fmt: skip
        materialized = wait_for(
            cluster, loom_operator, ns, "featureview", VIEW, "materialized",
            lambda o: condition(o, "Materialized").get("status") in ("True", "False"),
        )  # fmt: skip
        assert condition(materialized, "Materialized")["status"] == "True", materialized["status"]
        wait_for(
            cluster, loom_operator, ns, "inferenceservice", SERVICE, "Ready",
            lambda o: condition(o, "Ready").get("status") == "True",
        )  # fmt: skip
        print(f"[enrichment] FeatureView materialized and {SERVICE} Ready after {time.monotonic() - started:.1f}s")
        yield Enriched(cluster, loom_operator, ns, end, waiting)


def expected_scores(end: Any, drivers: list[int]) -> list[float]:
    frame = example_data.driver_stats(end).sort_values(["driver_id", "event_timestamp", "created"])
    newest = {int(r.driver_id): r for r in frame.groupby("driver_id").tail(1).itertuples()}
    weights = EXAMPLE_MODEL["weights"]
    return [
        sum(weights[f"driver_stats__{f}"] * float(getattr(newest[d], f)) for f in FEATURES) + EXAMPLE_MODEL["bias"]
        for d in drivers
    ]


def test_the_model_scores_each_driver_from_its_online_features(enriched: Enriched) -> None:
    # While the FeatureView was not Ready the InferenceService said so, instead of serving without features.
    assert enriched.waiting["status"] == "False" and "FeatureView driver-stats" in enriched.waiting["message"]
    config = get(enriched.cluster, enriched.namespace, "configmap", f"{SERVICE}-config")
    features = json.loads(config["data"]["server.json"])["features"]
    feature_server = f"http://rides-features.{enriched.namespace}.svc"
    assert (features["url"], features["featureView"]) == (feature_server, "driver_stats")
    response = enriched.infer([1001, 1002])
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert (outputs["score"]["datatype"], outputs["score"]["shape"]) == ("FP32", [2])
    assert outputs["score"]["data"] == pytest.approx(expected_scores(enriched.end, [1001, 1002]), rel=1e-5)


def test_an_unknown_driver_is_a_400_naming_it(enriched: Enriched) -> None:
    response = enriched.infer([1001, 9999])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "driver_id=9999: unknown entity" in error and "conv_rate NOT_FOUND" in error, error
    assert "1001" not in error


def metric(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{labels}\}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_enrichment_latency_and_errors_are_in_the_servers_metrics(enriched: Enriched) -> None:
    for _ in range(20):
        assert enriched.infer([1001]).status_code == 200
    assert enriched.infer([4242]).status_code == 400
    with httpx.Client(trust_env=False, timeout=30) as client:
        text = client.get(f"{enriched.url}/metrics").text
    labels = f'feature_view="driver_stats",model="{SERVICE}"'
    count = metric(text, "loom_server_enrichment_duration_seconds_count", labels)
    total = metric(text, "loom_server_enrichment_duration_seconds_sum", labels)
    assert count >= 20
    errors = metric(text, "loom_server_enrichment_errors_total", f'{labels},reason="entity_not_found"')
    assert errors >= 1
    print(f"[enrichment] mean enrichment latency over {count:.0f} calls: {1000 * total / count:.1f} ms")


def test_a_feature_server_outage_is_a_503_and_a_condition(enriched: Enriched) -> None:
    cluster, ns = enriched.cluster, enriched.namespace
    cluster.kubectl("patch", "featureview", VIEW, "-n", ns, "--type=merge", "-p", '{"spec":{"server":{"replicas":0}}}')
    isvc = wait_for(
        cluster, enriched.op, ns, "inferenceservice", SERVICE, "FeatureViewNotReady",
        lambda o: condition(o, "RolledOut").get("reason") == "FeatureViewNotReady",
    )  # fmt: skip
    # The server keeps running, and says why it is degraded.
    assert (condition(isvc, "Ready")["status"], isvc["status"]["phase"]) == ("True", "Degraded")

    def refused() -> httpx.Response | None:
        response = enriched.infer([1001])
        return response if response.status_code != 200 else None

    response = wait_until(refused, timeout=120, what="the feature server is gone", interval=1)
    assert response.status_code == 503, response.text
    assert f"feature server http://rides-features.{ns}.svc" in response.json()["error"]
