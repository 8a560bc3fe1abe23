"""From a finished training run to a promoted model, and a broken version rolled back, with no person judging: the
local stack with the real MLflow registry, S3 and Prometheus (scraping every second) and the operator reading it.

- A TrainingJob trains and registers version 2 of a model whose `champion` is version 1, moving `challenger`.
- An InferenceService follows `champion` with a canary analysis (steps of 25% and 50% with short pauses; checks
  on the error rate, the p99 latency and a PromQL of the test's own with `{{pods}}`). The test names `champion`'s
  candidate by moving the alias with the MLflow client, as a person or a pipeline would; the canary of version 2
  walks the steps and is promoted, and the operator records the promotion alias.
- Version 3 fails every second request. Named `champion`, its canary is rolled back at its first evaluation; its
  MLflow version carries the rejection tag and `champion` names the version that serves again.

Traffic: one client sends requests one after another, each on a new connection, for the whole test. The stack's
Service proxy spreads connections round robin over the ready replicas (replica-weighted, as status says), so while
a step runs with C canary replicas of 4, any 4k consecutive requests give the canary exactly k*C: the test checks
that exact share at each step. The only failed requests are the broken canary's own, within its share.
"""

from __future__ import annotations

import importlib
import json
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess, operator_namespace_for
from loom.e2e.rollout_evidence import rollout_evidence
from loom.e2e.share_failing_handler import MARKER, MESSAGE

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

REPLICAS = 4
TINY_MODEL = ["nLayer=1", "nEmbd=32", "nHead=2", "blockSize=16"]
ERRORS_QUERY = 'sum(rate(loom_server_requests_total{namespace="{{namespace}}",pod=~"{{pods}}"}[{{window}}]))'


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@dataclass
class Answer:
    at: float  # wall-clock time the request was sent
    code: int  # 0: no HTTP answer
    version: str | None
    text: str = ""


@dataclass
class Traffic:
    """One client, requests one after another, each on a new connection (so the proxy's round robin decides)."""

    url: str
    answers: list[Answer] = field(default_factory=list)
    turn: threading.Lock = field(default_factory=threading.Lock)  # held by a burst: no request of ours between
    stop: threading.Event = field(default_factory=threading.Event)

    def one(self) -> Answer:
        at = time.time()
        try:
            response = httpx.post(self.url, json=BODY, timeout=10, trust_env=False)
        except httpx.HTTPError as error:
            return Answer(at, 0, None, str(error))
        version = response.json().get("model_version") if response.status_code == 200 else None
        return Answer(at, response.status_code, version, "" if response.status_code == 200 else response.text)

    def run(self) -> None:
        while not self.stop.is_set():
            with self.turn:
                self.answers.append(self.one())
            time.sleep(0.04)

    def burst(self, count: int) -> list[Answer]:
        with self.turn:
            answers = [self.one() for _ in range(count)]
        self.answers.extend(answers)
        return answers


BODY = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}


@pytest.fixture
def promotion_namespace(cluster: Cluster, autoscaling_operator: OperatorProcess) -> Iterator[str]:
    with operator_namespace_for(cluster, autoscaling_operator) as name:
        yield name


def test_a_trained_model_is_promoted_and_a_broken_one_rolled_back(
    cluster: Cluster,
    autoscaling_operator: OperatorProcess,
    promotion_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns, operator = promotion_namespace, autoscaling_operator
    model = f"promo-{uuid.uuid4().hex[:6]}"
    bucket = f"promo-{uuid.uuid4().hex[:8]}"
    store = s3.client()
    store.create_bucket(Bucket=bucket)
    # Versions 1 and 3 are the test's own: any files do for the echoing handler; version 3 is broken.
    store.put_object(Bucket=bucket, Key="v1/model.txt", Body=b"version one")
    store.put_object(Bucket=bucket, Key="v3/model.txt", Body=b"version three")
    store.put_object(Bucket=bucket, Key=f"v3/{MARKER}", Body=b"2")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)
    registry = importlib.import_module("mlflow.tracking").MlflowClient()
    registry.create_registered_model(model)
    assert registry.create_model_version(model, f"s3://{bucket}/v1").version == "1"
    registry.set_registered_model_alias(model, "champion", "1")

    env = [{"name": "AWS_DEFAULT_REGION", "value": s3.region}, {"name": "OMP_NUM_THREADS", "value": "1"}]
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3-credentials"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }
    job = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "trainer"},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task", "args": TINY_MODEL},
            "maxSteps": 4,
            "env": env,
            "workers": {"replicas": 1, "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME}},
            "checkpoint": {
                "uri": f"s3://{bucket}/trainer",
                "endpoint": s3.url,
                "secretRef": {"name": "s3-credentials"},
                "everySteps": 4,
            },
            "tracking": {"mlflow": {"trackingUri": mlflow.url, "experiment": model}},
            "register": {"model": model, "alias": "challenger"},
        },
    }
    service = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "scorer"},
        "spec": {
            "model": {
                "mlflow": f"models:/{model}@champion",
                "trackingUri": mlflow.url,
                "endpoint": s3.url,
                "secretRef": {"name": "s3-credentials"},
                "aliasPollSeconds": 5,
            },
            "handler": "loom.e2e.share_failing_handler:ShareFailingModel",
            "replicas": REPLICAS,
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": env,
            "rollout": {
                "minReadySeconds": 0,
                "analysis": {
                    # Short windows: the test's; the defaults are minutes. Each step pauses long enough for the
                    # test's own look at it (its pods settle after a drain, then a burst judged for the exact share):
                    # with 10 s the canary walked both steps and was promoted while the test was still judging
                    # step 1, on a machine at load 3.
                    "steps": [{"weight": 25, "pauseSeconds": 60}, {"weight": 50, "pauseSeconds": 60}],
                    "intervalSeconds": 5,
                    "windowSeconds": 10,
                    "missingDataSeconds": 60,
                    "checks": [
                        {"name": "errors", "metric": "error-rate", "max": 0.05},
                        {"name": "latency", "metric": "latency-p99", "max": 5.0},
                        # The canary's own request rate ({{pods}}: its pods only): any traffic proves the selection;
                        # one sequential client on a loaded machine gives a canary pod well under 1 request/s.
                        {"name": "traffic", "metric": "prometheus", "query": ERRORS_QUERY, "min": 0.1},
                    ],
                    "promoteAlias": "champion",
                },
            },
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([secret, job, service]))

    def fail(error: Exception) -> AssertionError:
        return AssertionError(
            f"{error}\nservice: {json.dumps(get(cluster, ns, 'inferenceservice', 'scorer').get('status'), indent=1)}\n"
            f"job: {json.dumps(get(cluster, ns, 'trainingjob', 'trainer').get('status'), indent=1)}\n"
            f"{cluster.kubectl('get', 'pods', '-n', ns, '-o', 'wide', check=False).stdout}\n"
            f"{cluster.kubectl('get', 'events', '-n', ns, '--sort-by=.lastTimestamp', check=False).stdout}\n"
            f"{rollout_evidence(cluster, ns)}\n"
            f"{operator.log_tail(80)}"
        )

    def until(check: Any, what: str, timeout: float = 300) -> Any:
        try:
            return wait_until(check, timeout=timeout, what=what, interval=0.5)
        except TimeoutError as error:
            raise fail(error) from None

    def service_status() -> dict[str, Any]:
        return dict(get(cluster, ns, "inferenceservice", "scorer").get("status") or {})

    def steady(version: str) -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", "scorer")
        conds = conditions(obj)
        done = conds.get("Ready", {}).get("status") == "True" and conds.get("RolledOut", {}).get("status") == "True"
        serving = done and obj["status"].get("modelVersion") == version
        return obj if serving and not get(cluster, ns, "deployment", "scorer-canary") else None

    until(lambda: steady("1"), "the service to serve version 1 (champion)")
    traffic = Traffic(f"http://{service_address('scorer', ns, AGENT_STATE_DIR)}:80/v2/models/scorer/infer")
    sender = threading.Thread(target=traffic.run, daemon=True)
    sender.start()
    try:
        # The job registers version 2 and moves challenger; champion does not move by itself.
        done = until(lambda: get(cluster, ns, "trainingjob", "trainer").get("status", {}).get("registeredModel", {})
                     .get("version") and get(cluster, ns, "trainingjob", "trainer"), "the job to register", 600)
        job_status = done["status"]
        assert job_status["phase"] == "Succeeded"
        assert job_status["registeredModel"] == {
            "name": model, "version": "2", "alias": "challenger", "source": f"s3://{bucket}/trainer/final"
        }
        finished = stamp(job_status["completionTime"])
        candidate = registry.get_model_version_by_alias(model, "challenger")
        assert candidate.version == "2"
        assert candidate.run_id == job_status["mlflow"]["runId"]
        assert candidate.tags["loom.dev/trainingjob"] == f"{ns}/trainer"
        assert candidate.tags["loom.dev/checkpoint"] == job_status["checkpoint"]["latest"]
        assert "metric.loss" in candidate.tags
        assert registry.get_model_version_by_alias(model, "champion").version == "1"

        # A pipeline names champion's candidate: the service canaries version 2 against version 1.
        named_at = time.time()
        registry.set_registered_model_alias(model, "champion", candidate.version)
        for index, (canary_replicas, share) in enumerate([(1, 25), (2, 50)], start=1):
            def running(index: int = index) -> dict[str, Any] | None:
                analysis = (service_status().get("rollout") or {}).get("analysis") or {}
                # Holding is a running step too: the canary's new pod has no series yet (its {{pods}} query).
                on_step = analysis.get("step") == f"{index}/2" and analysis.get("verdict") in ("Analyzing", "Holding")
                return analysis if on_step and analysis.get("modelVersion") == "2" else None

            analysis = until(running, f"step {index} of the canary of version 2 to run")
            assert analysis["weight"] == share
            stable = get(cluster, ns, "deployment", "scorer")["spec"]["replicas"]
            canary = get(cluster, ns, "deployment", "scorer-canary")["spec"]["replicas"]
            assert (stable, canary) == (REPLICAS - canary_replicas, canary_replicas)
            assert service_status()["rollout"]["trafficSplit"] == "replica-weighted"
            # Once the replaced pods are gone (no terminating pod left to the proxy): round robin over 4 ready
            # replicas, exactly canary_replicas of every 4 connections reach the canary.
            tracks = {"stable": REPLICAS - canary_replicas, "canary": canary_replicas}
            for _attempt in range(4):
                until(lambda tracks=tracks: settled_pods(cluster, ns) == tracks, "the step's pods to settle")
                began = time.time()
                answers = traffic.burst(REPLICAS * 6)
                # A readiness probe that timed out on the loaded machine changes the proxy's replicas mid-burst:
                # the share is judged only over a burst no pod's readiness changed during (else: again).
                if settled_pods(cluster, ns) == tracks and last_ready_change(cluster, ns) < began - 1:
                    break
            else:
                raise fail(AssertionError("no burst of requests ran while the step's pods stayed ready"))
            assert all(a.code == 200 for a in answers), [a for a in answers if a.code != 200]
            pattern = "".join(str(a.version) for a in answers)
            assert sum(a.version == "2" for a in answers) == 6 * canary_replicas, pattern
            assert sum(a.version == "1" for a in answers) == 6 * (REPLICAS - canary_replicas)

        promoted = until(lambda: steady("2"), "version 2 promoted and rolled out")
        rollout = promoted["status"]["rollout"]
        assert rollout["analysis"]["verdict"] == "Promoted", rollout
        assert rollout["analysis"]["reason"] == "AnalysisPassed"
        assert {c["name"]: c["verdict"] for c in rollout["analysis"]["checks"]} == {
            "errors": "Pass", "latency": "Pass", "traffic": "Pass"
        }
        assert rollout["promotedAlias"] == "champion=2"
        assert registry.get_model_version_by_alias(model, "champion").version == "2"
        promoted_at = stamp(rollout["analysis"]["lastEvaluatedAt"])
        rolled_out_at = time.time()
        reasons = events(cluster, ns)
        for reason in ("CanaryStarted", "CanaryStep", "CanaryAdvanced", "CanaryPromoted"):
            assert reason in reasons, reasons
        assert "CanaryRolledBack" not in reasons
        healthy = list(traffic.answers)
        assert healthy and all(a.code == 200 for a in healthy), [a for a in healthy if a.code != 200][:5]

        # Version 3 fails every second request it answers. Named champion, it is judged and rolled back.
        store_source = f"s3://{bucket}/v3"
        assert registry.create_model_version(model, store_source).version == "3"
        moved_at = time.time()
        registry.set_registered_model_alias(model, "champion", "3")

        def rejected() -> dict[str, Any] | None:
            rollout = service_status().get("rollout") or {}
            entry = next((e for e in rollout.get("rejected", []) if e["modelVersion"] == "3"), None)
            return rollout if entry and entry["tagged"] else None

        rollout = until(rejected, "version 3 rolled back and tagged")
        retired_at = until(lambda: not serving_canary_pods(cluster, ns) and time.time(), "the broken canary retired")
        back = until(lambda: steady("2"), "version 2 serving alone again")
        time.sleep(3)  # requests after the canary left: none may fail
    finally:
        traffic.stop.set()
        sender.join(timeout=30)

    analysis = rollout["analysis"]
    assert (analysis["modelVersion"], analysis["verdict"], analysis["reason"]) == ("3", "RolledBack", "CheckFailed")
    assert analysis["step"] == "1/2"  # judged at its first step: never more than 25% of connections
    errors = next(c for c in analysis["checks"] if c["name"] == "errors")
    assert errors["verdict"] == "Fail" and errors["canary"] > 0.05, errors
    tag = registry.get_model_version(model, "3").tags["loom.dev/rejected"]
    assert tag.startswith("CheckFailed: errors: canary"), tag
    # champion named a rejected version: it names the version that serves again.
    assert registry.get_model_version_by_alias(model, "champion").version == "2"
    assert back["status"]["modelVersion"] == "2"

    during = [a for a in traffic.answers if a.at >= moved_at]
    failed = [a for a in during if a.code != 200]
    assert failed, "version 3 never answered a request: its rollback proves nothing"
    assert all(a.code == 500 and MESSAGE in a.text for a in failed), failed[:5]
    # The canary got one connection of every 4 and failed one of every 2 of its own: nothing beyond its share.
    canary_window = [a for a in during if a.at <= max(f.at for f in failed)]
    assert len(failed) <= math.ceil(len(canary_window) / REPLICAS), (len(failed), len(canary_window))
    assert not [a for a in during if a.at > retired_at and a.code != 200]
    assert {a.version for a in during if a.at > retired_at} == {"2"}
    assert any(a.version == "3" for a in during)
    print(
        f"[promotion] job finished -> promoted: {promoted_at - finished:.1f}s (champion named "
        f"{named_at - finished:.1f}s after it finished; named -> promoted {promoted_at - named_at:.1f}s); -> version 2 "
        f"serving alone: {rolled_out_at - finished:.1f}s; version 3 named -> canary out: {retired_at - moved_at:.1f}s; "
        f"{len(traffic.answers)} requests, {len(failed)} failed"
    )


def settled_pods(cluster: Cluster, namespace: str) -> dict[str, int] | None:
    """Ready server pods by track; None while any pod is not ready or terminating."""
    listed = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", "loom.dev/track", "-o", "json").stdout
    )["items"]
    counts: dict[str, int] = {}
    for pod in listed:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
        if pod["metadata"].get("deletionTimestamp") or not ready:
            return None
        track = pod["metadata"]["labels"]["loom.dev/track"]
        counts[track] = counts.get(track, 0) + 1
    return counts


def last_ready_change(cluster: Cluster, namespace: str) -> float:
    """The latest time any server pod turned ready or unready."""
    listed = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", "loom.dev/track", "-o", "json").stdout
    )["items"]
    return max(
        (stamp(c["lastTransitionTime"]) for p in listed for c in p["status"].get("conditions", [])
         if c["type"] == "Ready" and c.get("lastTransitionTime")),
        default=0.0,
    )


def serving_canary_pods(cluster: Cluster, namespace: str) -> list[str]:
    """Canary pods not yet terminating (a terminating pod is no endpoint of the Service any more)."""
    listed = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", "loom.dev/track=canary", "-o", "json").stdout
    )["items"]
    return [p["metadata"]["name"] for p in listed if not p["metadata"].get("deletionTimestamp")]


def events(cluster: Cluster, namespace: str) -> list[str]:
    listed = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    return [e["reason"] for e in listed if e["involvedObject"]["name"] == "scorer"]
