"""The builtin autoscaler under load that moves, and engines keda/hpa against the real API server.

- Oscillation: GPU utilisation swinging around the target faster than the scale-down window scales up once and
  holds (a flap would be a scale-down within the window); once the load stays low, it scales down once, a full
  window after the last high sample.
- Queue depth: real concurrent slow requests against a small chargpt model server fill its queue; Prometheus
  scrapes the server's own loom_server_queue_depth and the operator scales up.
- Engines: with KEDA's own CRDs installed (from KEDA's Go module), every ScaledObject and HPA the operator can
  render passes the API server's strict server-side dry run; with engine keda or hpa the operator applies that
  object and never writes a decision of its own, though the metric asks for more replicas.

Short decision rounds (1 s) and scrapes (1 s) through operator settings keep each test well under 90 s.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.cluster import Cluster, keda
from loom.devstack.cluster.handle import KubectlError, wait_until
from loom.devstack.images import IMAGE_SETTINGS
from loom.devstack.prometheus import PrometheusEndpoint
from loom.devstack.servers import S3Endpoint
from loom.e2e.autoscaling import (
    autoscaled,
    direction_changes,
    example,
    get,
    pod_ip,
    ready_pods,
    scale_writes,
    wait_for,
)
from loom.e2e.exporter import Exporter
from loom.e2e.pytest_operator import OperatorProcess, apply_crds, operator_namespace_for, operator_process
from loom.e2e.pytest_services import apply_s3_secret
from loom.operator.kinds.inferenceservice.api import Autoscaling
from loom.operator.kinds.inferenceservice.autoscaling.io import engine_object
from loom.operator.kinds.inferenceservice.render import SERVER_PORT
from loom.operator.settings import OperatorSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

INTERVAL_S = 1.0  # the operator's decision round here (default 5 s)
TIMEOUT_S = 90.0



@pytest.fixture(scope="module")
def fast_operator(
    cluster: Cluster, prometheus: PrometheusEndpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    keda.install_crds(cluster)  # `up` installs them too; a stack started before that change lacks them
    log = tmp_path_factory.mktemp("loom-operator") / "loom_operator.log"
    env = {"LOOM_PROMETHEUS_URL": prometheus.url, "LOOM_AUTOSCALE_INTERVAL_S": str(INTERVAL_S)}
    with operator_process(cluster, log, env) as handle:
        yield handle
    print(f"[loom operator] log: {log}", file=sys.__stderr__)


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(obj))


# --------------------------------------------------------------------------------------------------- oscillation


def test_load_oscillating_around_the_target_changes_direction_at_most_once_per_window(
    cluster: Cluster, fast_operator: OperatorProcess, s3: S3Endpoint, bucket: str
) -> None:
    """Total utilisation alternates 90 / 30 (mean 60, the target) every 2 s. Without a window, replicas would
    follow it: 90 on one replica asks for 2, 30 over two (15 each) asks for 1. With a 12 s scale-down window
    they go up once and hold while it swings, then down once after it stays low."""
    op, window = fast_operator, 12
    with operator_namespace_for(cluster, op) as namespace:
        apply_s3_secret(cluster, namespace, s3)
        s3.client().put_object(Bucket=bucket, Key="osc/weights.txt", Body=b"weights\n")
        obj = example(namespace, s3, f"s3://{bucket}/osc")
        name = obj["metadata"]["name"]
        obj["spec"]["autoscaling"]["scaleDown"] = {"stabilizationWindowSeconds": window}
        exporter = Exporter(cluster, namespace)
        exporter.start()
        apply(cluster, namespace, obj)
        wait_for(cluster, namespace, name, lambda o: (o.get("status") or {}).get("readyReplicas") == 1,
                 "one replica ready", timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip

        def publish(total: float) -> float:
            pods = ready_pods(cluster, namespace, name)
            return exporter.publish({pod: total / len(pods) for pod in pods})

        seen: set[tuple[int, float]] = set()  # (replicas, per-replica value) as the operator reported them
        started = time.time()
        while time.time() - started < 2.5 * window:
            publish(90)
            time.sleep(2)  # the load's own rhythm, not a wait for the system
            publish(30)
            time.sleep(2)
            current = get(cluster, namespace, name)
            value = autoscaled(current).get("metricValue")
            if value is not None:
                seen.add((int(current["spec"].get("replicas") or 1), float(value)))
        swinging = scale_writes(op.log, namespace, name)
        assert [(w.reason, w.before, w.after) for w in swinging] == [("ScaledUp", 1, 2)], op.log_tail(80)
        # The operator did see the low phase at two replicas (15 on each ready one, or 30 on the only ready one
        # while the other starts: either asks for 1): only the window held them.
        assert any(replicas == 2 and value <= 30 for replicas, value in seen), seen

        # The load stays low: one scale-down, a full window after the last high sample was published.
        publish(30)
        wait_for(cluster, namespace, name, lambda o: o["spec"].get("replicas") == 1, "scaled down to 1",
                 timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
        # The write is logged just after it lands: read the log once it holds two.
        writes = wait_until(lambda: (lambda w: w if len(w) >= 2 else None)(scale_writes(op.log, namespace, name)),
                            timeout=10, what="the scale-down logged")  # fmt: skip
        assert [(w.reason, w.before, w.after) for w in writes] == [("ScaledUp", 1, 2), ("ScaledDown", 2, 1)]
        assert direction_changes(writes) == 1
        # A window's worth of recommendations of 2 stood between the two (0.5 s: the log stamps follow the writes).
        assert writes[1].at - writes[0].at >= window - 0.5


# --------------------------------------------------------------------------------------------------- queue depth


def tiny_chargpt(tmp_path: Path) -> Path:
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    torch.manual_seed(0)
    config = chargpt.GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    return save_for_serving(chargpt.GPT(config), tmp_path / "tiny-gpt")


class SlowRequests:
    """`workers` clients, each sending long greedy generations back to back until stopped; records statuses."""

    def __init__(self, url: str, model: str, workers: int, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        body = {"text_input": "To be", "parameters": {"max_tokens": self.max_tokens, "temperature": 0}}
        with httpx.Client(trust_env=False, timeout=120) as http:
            while not self._stop.is_set():
                try:
                    response = http.post(f"{self.url}/v2/models/{self.model}/generate", json=body)
                    self.statuses.append(response.status_code)
                except httpx.HTTPError:
                    self.statuses.append(-1)

    def __enter__(self) -> SlowRequests:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def scaled_up_to_2(obj: dict[str, Any]) -> bool:
    # The scale write comes first, its status after: wait for both.
    return bool(obj["spec"].get("replicas") == 2 and autoscaled(obj).get("lastScaleReason") == "ScaledUp")


def test_queue_depth_from_real_requests_scales_the_chargpt_server_up(
    cluster: Cluster, fast_operator: OperatorProcess, s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    """One request at a time per batch (maxBatchSize 1) and 6 clients: about 5 wait in the queue, over a target
    of 2 per replica. The server's own gauge, scraped by Prometheus, scales 1 -> 2 and the new replica comes up."""
    op = fast_operator
    with operator_namespace_for(cluster, op) as namespace:
        apply_s3_secret(cluster, namespace, s3)
        for path in tiny_chargpt(tmp_path).iterdir():
            s3.client().put_object(Bucket=bucket, Key=f"gpt/{path.name}", Body=path.read_bytes())
        obj = example(namespace, s3, f"s3://{bucket}/gpt")
        name = obj["metadata"]["name"] = "chargpt-queue"
        spec = obj["spec"]
        spec["handler"] = "chargpt"
        spec["env"].append({"name": "OMP_NUM_THREADS", "value": "1"})
        spec["batching"] = {"maxBatchSize": 1, "maxLatencyMs": 0}
        spec["autoscaling"] = {
            "minReplicas": 1, "maxReplicas": 2, "metric": "queue-depth", "target": 2, "metricMaxAgeSeconds": 30,
        }  # fmt: skip
        apply(cluster, namespace, obj)
        started = time.monotonic()
        wait_for(cluster, namespace, name, lambda o: (o.get("status") or {}).get("readyReplicas") == 1,
                 "one replica ready", timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
        print(f"[autoscaling] chargpt server ready in {time.monotonic() - started:.1f}s", file=sys.__stderr__)
        # Idle: an empty queue, read through Prometheus, holds one replica.
        idle = wait_for(cluster, namespace, name, lambda o: autoscaled(o).get("metricValue") == 0,
                        "an empty queue seen", timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
        assert idle["spec"].get("replicas") is None and autoscaled(idle)["desiredReplicas"] == 1

        (first,) = ready_pods(cluster, namespace, name)
        url = f"http://{pod_ip(cluster, namespace, first)}:{SERVER_PORT}"
        loaded = time.monotonic()
        with SlowRequests(url, name, workers=6, max_tokens=256) as load:
            wait_for(cluster, namespace, name, scaled_up_to_2, "scaled up on queue depth and reported",
                     timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
            requested = time.monotonic()
        (write,) = scale_writes(op.log, namespace, name)
        assert (write.reason, write.after) == ("ScaledUp", 2)
        # Decided on waiting requests per replica over the target. (Not status.metricValue when the scale-up is
        # seen: that is the latest reading, and a loaded machine once showed 0 there, the clients being slow.)
        assert write.metric is not None and write.metric > 2, write.message
        # The queue was real work: every request that finished was answered, none refused.
        assert load.statuses and set(load.statuses) == {200}, load.statuses
        # Load gone: the new replica still comes up (the 300 s default scale-down window keeps it asked for).
        served = wait_for(cluster, namespace, name, lambda o: o["status"].get("readyReplicas") == 2,
                          "the second replica ready", timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
        assert served["spec"]["replicas"] == 2
        print(f"[autoscaling] queue depth: load -> replica requested {requested - loaded:.1f}s, "
              f"-> Ready {time.monotonic() - loaded:.1f}s", file=sys.__stderr__)  # fmt: skip


# ------------------------------------------------------------------------------------------------ engines keda/hpa


def dry_run(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Create `obj` in a strict server-side dry run: schema, unknown fields and admission, nothing stored."""
    out = cluster.kubectl(
        "create", "-n", namespace, "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-",
        stdin=json.dumps(obj),
    )  # fmt: skip
    return dict(json.loads(out.stdout))


def owner(namespace: str, name: str) -> dict[str, Any]:
    uid = str(uuid.uuid4())
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}}  # fmt: skip


def test_engines_keda_and_hpa_render_objects_the_api_server_accepts_and_never_write_replicas(
    cluster: Cluster, fast_operator: OperatorProcess, prometheus: PrometheusEndpoint, s3: S3Endpoint, bucket: str
) -> None:
    op = fast_operator
    settings = OperatorSettings(**IMAGE_SETTINGS, prometheus_url=prometheus.url)
    with operator_namespace_for(cluster, op) as namespace:
        # Every metric each engine can scale on, as rendered: KEDA's schema and autoscaling/v2 accept them whole.
        keda_specs: list[dict[str, Any]] = [
            {"metric": "queue-depth", "target": 4},
            {"metric": "gpu-utilization", "target": 60},
            {"metric": "gpu-memory", "target": 80},
            {"metric": "concurrency", "target": 2.5},
            {"metric": "requests-per-second", "target": 20},
            {"metric": "prometheus", "target": 100, "query": "sum(rate(http_requests_total[1m]))"},
            {"metric": "queue-depth", "target": 1, "minReplicas": 0, "idleSeconds": 120},
        ]
        hpa_specs: list[dict[str, Any]] = [
            {"metric": m, "target": 3} for m in ("gpu-utilization", "queue-depth", "concurrency", "requests-per-second")
        ]
        windows = {"scaleUp": {"stabilizationWindowSeconds": 15, "policies": [{"type": "Pods", "value": 2,
                   "periodSeconds": 15}]}, "scaleDown": {"stabilizationWindowSeconds": 300}}  # fmt: skip
        for engine, specs in (("keda", keda_specs), ("hpa", hpa_specs)):
            for i, extra in enumerate(specs):
                autoscaling = Autoscaling.model_validate({"maxReplicas": 5, "engine": engine, **windows, **extra})
                rendered, _ = engine_object(owner(namespace, f"{engine}-{i}"), autoscaling, settings)
                assert rendered is not None
                accepted = dry_run(cluster, namespace, rendered)
                assert contains(accepted["spec"], rendered["spec"]), (engine, extra, accepted["spec"])  # none dropped
                assert accepted["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
                for trigger in accepted["spec"].get("triggers", []):
                    # KEDA's schema keeps trigger metadata as strings; KEDA reads thresholds as JSON numbers.
                    assert isinstance(json.loads(trigger["metadata"]["threshold"]), int | float), trigger

        # The dry run is a real check: KEDA's schema refuses what it does not know, and an empty trigger type.
        so, _ = engine_object(owner(namespace, "bad"), Autoscaling(max_replicas=3, target=4), settings)
        assert so is None  # builtin renders nothing
        so, _ = engine_object(
            owner(namespace, "bad"), Autoscaling(max_replicas=3, target=4, engine="keda"), settings
        )
        assert so is not None
        with pytest.raises(KubectlError, match="pollingIntervall"):
            dry_run(cluster, namespace, {**so, "spec": {**so["spec"], "pollingIntervall": 10}})
        with pytest.raises(KubectlError, match="type"):
            dry_run(cluster, namespace, {**so, "spec": {**so["spec"], "triggers": [{**so["spec"]["triggers"][0],
                                                                                     "type": ""}]}})  # fmt: skip

        # The operator with engine keda: it applies the ScaledObject and, though 90% over a 60% target asks for
        # 2 replicas, writes nothing but the starting point; engine hpa likewise; builtin then scales at once.
        apply_s3_secret(cluster, namespace, s3)
        s3.client().put_object(Bucket=bucket, Key="eng/weights.txt", Body=b"weights\n")
        obj = example(namespace, s3, f"s3://{bucket}/eng")
        name = obj["metadata"]["name"] = "chat-engines"
        obj["spec"]["autoscaling"]["engine"] = "keda"
        exporter = Exporter(cluster, namespace)
        exporter.start()
        apply(cluster, namespace, obj)

        def engine_objects() -> dict[str, dict[str, Any] | None]:
            found: dict[str, dict[str, Any] | None] = {}
            for kind in ("scaledobject.keda.sh", "horizontalpodautoscaler.autoscaling"):
                got = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
                found[kind.split(".")[0]] = json.loads(got.stdout) if got.returncode == 0 else None
            return found

        scaled_object = wait_until(lambda: engine_objects()["scaledobject"], timeout=TIMEOUT_S,
                                   what="the ScaledObject applied")  # fmt: skip
        assert scaled_object["metadata"]["ownerReferences"][0]["name"] == name
        trigger = scaled_object["spec"]["triggers"][0]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        assert trigger["metadata"]["serverAddress"] == prometheus.url and "DCGM_FI_" in trigger["metadata"]["query"]
        wait_for(cluster, namespace, name, lambda o: (o.get("status") or {}).get("readyReplicas") == 1,
                 "one replica ready", timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
        (pod,) = ready_pods(cluster, namespace, name)
        exporter.publish({pod: 90})
        sample = f'DCGM_FI_DEV_GPU_UTIL{{exported_namespace="{namespace}",exported_pod="{pod}"}}'
        wait_until(lambda: prometheus_value(prometheus, sample) == 90, timeout=30, what="90% in Prometheus")
        for engine in ("keda", "hpa"):
            if engine == "hpa":
                obj["spec"]["autoscaling"]["engine"] = "hpa"
                apply(cluster, namespace, obj)
                wait_until(lambda: (lambda f: f["horizontalpodautoscaler"] and not f["scaledobject"])(engine_objects()),
                           timeout=TIMEOUT_S, what="the HPA instead of the ScaledObject")  # fmt: skip
            time.sleep(4 * INTERVAL_S)  # four decision rounds with the metric asking for 2 replicas
            held = get(cluster, namespace, name)
            assert held["spec"]["replicas"] == 1, engine  # the starting point, written once
            assert not autoscaled(held).get("lastScaleReason"), engine
            assert scale_writes(op.log, namespace, name) == [], engine

        obj["spec"]["autoscaling"]["engine"] = "builtin"
        apply(cluster, namespace, obj)
        wait_for(cluster, namespace, name, lambda o: o["spec"].get("replicas") == 2, "builtin scaled up",
                 timeout=TIMEOUT_S, context=op.log_tail)  # fmt: skip
        assert engine_objects() == {"scaledobject": None, "horizontalpodautoscaler": None}


def contains(big: Any, small: Any) -> bool:
    """Whether every field of `small` is in `big` with the same value (`big` may have defaults added)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(big) == len(small) and all(map(contains, big, small))
    return bool(big == small)


def prometheus_value(prometheus: PrometheusEndpoint, query: str) -> float | None:
    answer = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": query}, timeout=5, trust_env=False).json()
    result = answer["data"]["result"]
    return float(result[0]["value"][1]) if result else None
