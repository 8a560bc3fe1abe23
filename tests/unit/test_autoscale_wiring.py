"""The builtin autoscaler's wiring: the spec's mapping onto the decision, the status and events it reports, and
one autoscaler round against an in-memory API server and a fake Prometheus (the real ones: e2e/tests/
test_autoscaling.py)."""

from __future__ import annotations

import copy
import json
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from pydantic import ValidationError

from loom.devstack.images import IMAGE_SETTINGS
from loom.operator.api.cel import admitted
from loom.operator.autoscale import loop as module
from loom.operator.autoscale.decision import MetricUnavailable, MetricValue, Observation, ScalingState, decide
from loom.operator.autoscale.prometheus import PrometheusClient
from loom.operator.autoscale.report import autoscaling_status, decision_events, metrics_condition, ready_pod_names
from loom.operator.autoscale.spec import metric_query, scaling_config
from loom.operator.core import client as kube
from loom.operator.kinds.inferenceservice.api import Autoscaling, InferenceServiceSpec
from loom.operator.kinds.inferenceservice.autoscaling.io import ADAPTER as ISVC_ADAPTER
from loom.operator.kinds.inferenceservice.autoscaling.replicas import current_replicas, recommend_replicas
from loom.operator.kinds.inferenceservice.rollout import desired_total_replicas
from loom.operator.settings import OperatorSettings

MODEL = {"uri": "s3://models/m"}


def spec(replicas: int | None = None, **autoscaling: Any) -> InferenceServiceSpec:
    body: dict[str, Any] = {"model": MODEL, "autoscaling": {"maxReplicas": 4, "target": 50, **autoscaling}}
    if replicas is not None:
        body["replicas"] = replicas
    return InferenceServiceSpec.model_validate(body)


def test_api_refuses_inconsistent_autoscaling() -> None:
    with pytest.raises(ValidationError, match="query is required"):
        admitted(Autoscaling, {"maxReplicas": 2, "target": 1, "metric": "prometheus"})
    with pytest.raises(ValidationError, match="only allowed"):
        admitted(Autoscaling, {"maxReplicas": 2, "target": 1, "metric": "concurrency", "query": "up"})
    with pytest.raises(ValidationError, match="idleSeconds needs minReplicas 0"):
        admitted(Autoscaling, {"maxReplicas": 2, "target": 1, "idleSeconds": 60})
    with pytest.raises(ValidationError, match="minReplicas"):
        admitted(Autoscaling, {"minReplicas": 3, "maxReplicas": 2, "target": 1})


def test_behaviour_maps_policies_windows_and_defaults() -> None:
    a = Autoscaling.model_validate(
        {
            "minReplicas": 0, "maxReplicas": 9, "target": 5, "metric": "queue-depth", "tolerance": 0.2,
            "idleSeconds": 120, "metricMaxAgeSeconds": 20,
            "scaleUp": {"policies": [{"type": "Pods", "value": 2, "periodSeconds": 10}], "selectPolicy": "Min"},
            "scaleDown": {"stabilizationWindowSeconds": 60, "selectPolicy": "Disabled"},
        }
    )  # fmt: skip
    cfg = scaling_config(a)
    assert (cfg.tolerance, cfg.idle_seconds, cfg.metric_max_age_seconds) == (0.2, 120, 20)
    assert cfg.scale_up.stabilization_window_seconds == 0  # HPA's default kept
    assert [(p.type, p.value, p.period_seconds) for p in cfg.scale_up.policies] == [("pods", 2, 10)]
    assert cfg.scale_up.select_policy == "min"
    assert cfg.scale_down.stabilization_window_seconds == 60 and cfg.scale_down.select_policy == "disabled"
    assert cfg.scale_down.policies  # HPA's default rate limit kept
    plain = scaling_config(Autoscaling.model_validate({"minReplicas": 0, "maxReplicas": 2, "target": 1}))
    assert plain.idle_seconds == 300 and plain.scale_down.stabilization_window_seconds == 300


def test_user_query_needs_no_pods_and_rate_window_reaches_the_query() -> None:
    users = Autoscaling.model_validate({"maxReplicas": 2, "target": 1, "metric": "prometheus", "query": "sum(x)"})
    assert metric_query(users, "ns", []).value == "sum(x)"
    rps = Autoscaling.model_validate({"maxReplicas": 2, "target": 1, "metric": "requests-per-second"})
    assert "[45s]" in metric_query(rps, "ns", ["a"], rate_window_seconds=45).value


def test_replicas_written_by_the_autoscaler_are_followed_within_bounds() -> None:
    assert recommend_replicas(spec(), 0) is None
    assert current_replicas(spec()) == 1  # nothing written yet: minReplicas
    assert recommend_replicas(spec(replicas=3), 1) == 3
    assert desired_total_replicas(spec(replicas=3), 3) == 3
    # A hand-made `kubectl scale` beyond the bounds is clamped by the reconcile pass and by the autoscaler.
    assert desired_total_replicas(spec(replicas=9), 9) == 4
    assert current_replicas(spec(replicas=9)) == 4
    fixed = InferenceServiceSpec.model_validate({"model": MODEL, "replicas": 2})
    assert (recommend_replicas(fixed, 2), current_replicas(fixed), desired_total_replicas(fixed)) == (None, 2, 2)


def pod(name: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_only_ready_pods_that_stay_count() -> None:
    pods = [pod("b", True), pod("a", True), pod("c", False), pod("d", True, deleting=True)]
    assert ready_pod_names(pods) == ["a", "b"]


def test_status_condition_and_events_of_a_scale_up_then_a_hold() -> None:
    a = Autoscaling.model_validate({"maxReplicas": 4, "target": 50, "metric": "gpu-utilization"})
    cfg = scaling_config(a)
    up = decide(
        cfg,
        ScalingState.initial(1000, 1),
        Observation(
            now=1000, current_replicas=1, ready_replicas=1, metric=MetricValue(value=90, timestamp=998, pods=1)
        ),
    )
    status = autoscaling_status(a, up, None)
    assert (status.current_replicas, status.desired_replicas, status.metric_value) == (1, 2, 90)
    assert status.metric_timestamp == "1970-01-01T00:16:38Z"
    assert (status.last_scale_time, status.last_scale_reason) == ("1970-01-01T00:16:40Z", "ScaledUp")
    ok = metrics_condition("gpu-utilization", up, 3)
    assert (ok.status, ok.reason, ok.observed_generation) == ("True", "MetricsRead", 3)
    events = decision_events(up, None, ok)
    assert events[0] == ("Normal", "ScaledUp", f"replicas 1 -> 2: {up.message}")

    held = decide(
        cfg,
        up.state,
        Observation(
            now=1010,
            current_replicas=2,
            ready_replicas=2,
            metric=MetricUnavailable(reason="MetricStale", message="too old", timestamp=900),
        ),
    )
    assert held.desired_replicas == 2
    later = autoscaling_status(a, held, status)
    assert (later.desired_replicas, later.metric_value) == (2, None)
    assert (later.last_scale_time, later.last_scale_reason) == (status.last_scale_time, "ScaledUp")  # carried
    bad = metrics_condition("gpu-utilization", held, 3)
    assert (bad.status, bad.reason) == ("False", "MetricStale") and "too old" in bad.message
    assert decision_events(held, ok, bad) == [("Warning", "MetricStale", f"MetricsAvailable=False: {bad.message}")]
    assert decision_events(held, bad, bad) == []  # announced once


# ------------------------------------------------------------------------------------------ one round


class FakeApi:
    """The InferenceService, its pods and the scale/status writes, with resourceVersion preconditions."""

    def __init__(self, body: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.body = body
        self.pods = pods
        self.writes: list[tuple[str | None, dict[str, Any]]] = []
        self.conflicts = 0  # the next writes that lose a race
        self.status_conflicts = 0  # the next status writes that lose a race
        self.deleted: list[str] = []
        self.applied: list[dict[str, Any]] = []

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str, **_: Any) -> bool:
        self.deleted.append(kind)
        return False

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.applied.append(manifest)
        return manifest

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.body)

    async def list_objects(self, api_version: str, kind: str, namespace: str | None, selector: str) -> list[Any]:
        assert kind == "Pod" and "app.kubernetes.io/instance=chat" in selector
        return copy.deepcopy(self.pods)

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any], **kw: Any
    ) -> dict[str, Any]:
        meta = self.body["metadata"]
        if kw.get("subresource") == "status" and self.status_conflicts:
            self.status_conflicts -= 1
            raise kube.Conflict("status changed")
        if self.conflicts:
            self.conflicts -= 1
            meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)  # someone else wrote
            raise kube.Conflict("changed")
        assert body["metadata"]["resourceVersion"] == meta["resourceVersion"]
        assert kw["field_manager"] == "loom-autoscaler"
        self.writes.append((kw.get("subresource"), body))
        if kw.get("subresource") == "scale":
            self.body["spec"]["replicas"] = body["spec"]["replicas"]
        else:
            self.body.setdefault("status", {}).update(body["status"])
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return {"metadata": {"resourceVersion": meta["resourceVersion"]}}


def prometheus(utilisation: dict[str, float], now: float) -> PrometheusClient:
    def answer(request: httpx.Request) -> httpx.Response:
        query = parse_qs(request.content.decode())["query"][0]
        taken = query.startswith("(min by (pod) (timestamp(")
        result = [{"metric": {"pod": p}, "value": [now, str(now - 2 if taken else v)]} for p, v in utilisation.items()]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})

    return PrometheusClient("http://prom:9090", client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    body = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1, "resourceVersion": "10"},
        "spec": {"model": MODEL, "autoscaling": {"maxReplicas": 4, "target": 50, "metric": "gpu-utilization"}},
    }
    fake = FakeApi(body, [pod("chat-1-a", True)])
    for name in ("get", "list_objects", "merge_patch", "delete", "apply"):
        monkeypatch.setattr(kube, name, getattr(fake, name))
    return fake


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(module, "post_events", lambda body, evs: seen.extend((e.type, e.reason) for e in evs))
    return seen


async def test_a_round_scales_up_once_through_the_scale_subresource_despite_a_race(
    api: FakeApi, events: list[tuple[str, str]]
) -> None:
    clock = [1000.0]
    scaler = module.Autoscaler(
        OperatorSettings(**IMAGE_SETTINGS, prometheus_url="http://prom:9090"),
        adapter=ISVC_ADAPTER,
        clock=lambda: clock[0],
    )
    scaler._prometheus = prometheus({"chat-1-a": 90.0}, 1000.0)
    api.conflicts = 1  # a status write of the reconcile pass lands first
    await scaler.round([("ns", "chat")])
    scale = [w for w in api.writes if w[0] == "scale"]
    assert [w[1]["spec"] for w in scale] == [{"replicas": 2}]  # once, from the fresh read
    assert sorted(api.deleted) == ["HorizontalPodAutoscaler", "ScaledObject"] and not api.applied  # no leftovers
    status = api.body["status"]
    assert status["autoscaling"]["desiredReplicas"] == 2 and status["autoscaling"]["lastScaleReason"] == "ScaledUp"
    assert [c["type"] for c in status["conditions"]] == ["MetricsAvailable"]
    assert ("Normal", "ScaledUp") in events and ("Normal", "MetricsRead") in events

    # The new replica is not ready yet: the same load asks for nothing more (it counts as capacity).
    api.pods.append(pod("chat-1-b", False))
    clock[0] = 1005.0
    await scaler.round([("ns", "chat")])
    assert len([w for w in api.writes if w[0] == "scale"]) == 1
    assert scaler.remembered == {("ns", "chat")}
    await scaler.round([])
    assert scaler.remembered == frozenset()
    await scaler.stop()


async def test_without_prometheus_the_replicas_hold_and_the_condition_says_why(
    api: FakeApi, events: list[tuple[str, str]]
) -> None:
    api.body["spec"]["replicas"] = 3
    scaler = module.Autoscaler(OperatorSettings(**IMAGE_SETTINGS), adapter=ISVC_ADAPTER, clock=lambda: 1000.0)
    await scaler.round([("ns", "chat")])
    assert not [w for w in api.writes if w[0] == "scale"]
    (cond,) = api.body["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "QueryFailed") and "LOOM_PROMETHEUS_URL" in cond["message"]
    assert events == [("Warning", "QueryFailed")]
    assert json.dumps(api.body["status"]).count("desiredReplicas") == 1


def test_index_selects_autoscaled_objects() -> None:
    assert module.autoscaled({"autoscaling": {"maxReplicas": 2}}, ISVC_ADAPTER)
    assert module.autoscaled({"autoscaling": {"engine": "keda"}}, ISVC_ADAPTER)
    assert not module.autoscaled({"replicas": 2}, ISVC_ADAPTER)


async def test_engines_hpa_and_keda_get_their_object_and_the_loop_never_writes_replicas(
    api: FakeApi, events: list[tuple[str, str]]
) -> None:
    api.body["spec"]["autoscaling"]["engine"] = "hpa"
    scaler = module.Autoscaler(
        OperatorSettings(**IMAGE_SETTINGS, prometheus_url="http://prom:9090"),
        adapter=ISVC_ADAPTER,
        clock=lambda: 1000.0,
    )
    scaler._prometheus = prometheus({"chat-1-a": 99.0}, 1000.0)
    await scaler.round([("ns", "chat")])
    await scaler.round([("ns", "chat")])  # applied once per engine, not every round
    assert [(o["kind"], o["spec"]["scaleTargetRef"]["name"]) for o in api.applied] == [
        ("HorizontalPodAutoscaler", "chat")
    ]
    owner = api.applied[0]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("InferenceService", "u1")
    # Only the starting point is written (an HPA reads replicas 0 as "disabled"), never a decision.
    start = ("scale", {"metadata": {"resourceVersion": "10"}, "spec": {"replicas": 1}})
    assert api.deleted == ["ScaledObject"] and api.writes == [start]
    api.body["spec"]["autoscaling"]["engine"] = "keda"
    await scaler.round([("ns", "chat")])
    assert api.applied[-1]["kind"] == "ScaledObject" and api.deleted[-1] == "HorizontalPodAutoscaler"
    assert len(api.writes) == 1 and ("Normal", "AutoscalerApplied") in events


async def test_an_engine_that_cannot_do_it_is_announced_once(api: FakeApi, events: list[tuple[str, str]]) -> None:
    api.body["spec"]["autoscaling"].update({"engine": "hpa", "metric": "gpu-memory"})
    scaler = module.Autoscaler(OperatorSettings(**IMAGE_SETTINGS), adapter=ISVC_ADAPTER, clock=lambda: 1000.0)
    await scaler.round([("ns", "chat")])
    await scaler.round([("ns", "chat")])
    assert events == [("Warning", "AutoscalingInvalid")] and not api.applied and not api.writes


async def test_a_status_write_lost_to_a_race_is_repaired_with_the_last_scale(
    api: FakeApi, events: list[tuple[str, str]]
) -> None:
    clock = [1000.0]
    scaler = module.Autoscaler(
        OperatorSettings(**IMAGE_SETTINGS, prometheus_url="http://prom:9090"),
        adapter=ISVC_ADAPTER,
        clock=lambda: clock[0],
    )
    scaler._prometheus = prometheus({"chat-1-a": 90.0}, 1000.0)
    api.status_conflicts = 1  # the reconcile pass writes the status between the scale and ours
    await scaler.round([("ns", "chat")])
    assert api.body["spec"]["replicas"] == 2 and "status" not in api.body
    api.pods.append(pod("chat-1-b", False))
    clock[0] = 1005.0
    await scaler.round([("ns", "chat")])
    scaled = api.body["status"]["autoscaling"]
    assert (scaled["lastScaleReason"], scaled["lastScaleTime"]) == ("ScaledUp", "1970-01-01T00:16:40Z")
    # An outage clears the value seen (null in the merge patch), the last scale stays.
    scaler._prometheus = prometheus({}, 1010.0)
    clock[0] = 1010.0
    await scaler.round([("ns", "chat")])
    scaled = api.body["status"]["autoscaling"]
    assert scaled["metricValue"] is None and scaled["lastScaleReason"] == "ScaledUp"
    assert api.body["status"]["conditions"][0]["reason"] == "MetricMissing"
    await scaler.stop()
