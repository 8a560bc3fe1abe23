"""Autoscaling beyond InferenceServices: the InferenceGraph router and the FeatureView feature server reuse the same
Autoscaling model, decision and loop through a per-kind adapter (kinds/<kind>/autoscaling/io.py). Here: what the
API admits, the scale subresource of InferenceGraph, how the renders keep the autoscaler's replicas, and one round
of each kind's loop against an in-memory API server and a fake Prometheus (the real ones:
e2e/tests/test_autoscaling_kinds.py)."""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from pydantic import ValidationError

from loom.devstack.images import IMAGE_SETTINGS
from loom.operator.api.cel import admitted
from loom.operator.api.crd import crd_for
from loom.operator.api.kinds import INFERENCE_GRAPH
from loom.operator.autoscale import loop as module
from loom.operator.autoscale.prometheus import PrometheusClient
from loom.operator.core import client as kube
from loom.operator.kinds.featureview.api import FeatureServer, FeatureViewSpec
from loom.operator.kinds.featureview.autoscaling.io import ADAPTER as FEATURE_VIEW
from loom.operator.kinds.featureview.autoscaling.io import project_autoscaling
from loom.operator.kinds.featureview.config import Member, plan_project
from loom.operator.kinds.featureview.render import render_deployment as render_feature_server
from loom.operator.kinds.featureview.render import server_replicas
from loom.operator.kinds.inferencegraph.api import GraphRouter, InferenceGraphSpec, InferenceGraphStatus
from loom.operator.kinds.inferencegraph.autoscaling.io import ADAPTER as GRAPH_ADAPTER
from loom.operator.kinds.inferencegraph.render import render_deployment as render_router
from loom.operator.kinds.inferencegraph.status import Observed, compute_status
from loom.operator.kinds.inferenceservice.autoscaling.io import ADAPTER as ISVC_ADAPTER
from loom.operator.settings import OperatorSettings

NODES = {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}
RPS = {"minReplicas": 1, "maxReplicas": 4, "metric": "requests-per-second", "target": 10}
QUERY = {"minReplicas": 1, "maxReplicas": 3, "metric": "prometheus", "query": "sum(rate(x[1m]))", "target": 50}


def graph_spec(replicas: int = 1, **autoscaling: Any) -> InferenceGraphSpec:
    router: dict[str, Any] = {"replicas": replicas}
    if autoscaling:
        router["autoscaling"] = autoscaling
    return InferenceGraphSpec.model_validate({"nodes": NODES, "router": router})


def view_spec(**server: Any) -> FeatureViewSpec:
    return FeatureViewSpec.model_validate({
        "project": "rides",
        "entities": [{"name": "driver_id"}],
        "features": [{"name": "trips", "dtype": "Int64"}],
        "source": {"path": "/data/stats.parquet"},
        "server": server,
    })  # fmt: skip


# ------------------------------------------------------------------------------------------ API and CRD


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"minReplicas": 0}, "does not scale to zero"),
        ({"engine": "keda"}, "engine builtin only"),
        ({"metric": "gpu-utilization"}, "concurrency, requests-per-second or prometheus"),
    ],
)
def test_the_router_refuses_what_it_cannot_scale_on(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        admitted(GraphRouter, {"autoscaling": {**RPS, **change}})


def test_the_feature_server_scales_on_a_query_only_and_never_to_zero() -> None:
    assert admitted(FeatureServer, {"autoscaling": QUERY}).autoscaling is not None
    with pytest.raises(ValidationError, match="metric prometheus"):
        admitted(FeatureServer, {"autoscaling": RPS})
    with pytest.raises(ValidationError, match="does not scale to zero"):
        admitted(FeatureServer, {"autoscaling": {**QUERY, "minReplicas": 0}})


def test_the_crds_admit_the_same_rules_and_the_graph_has_a_scale_subresource() -> None:
    crd = crd_for(INFERENCE_GRAPH)
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.router.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    router = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    rules = [r["rule"] for r in router["x-kubernetes-validations"]]
    assert any("minReplicas >= 1" in r for r in rules) and any("'requests-per-second'" in r for r in rules)
    assert "autoscaling" in router["properties"]


# ------------------------------------------------------------------------------------------ renders


def test_the_router_deployment_follows_the_autoscaler_within_bounds() -> None:
    owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceGraph",
             "metadata": {"name": "g", "namespace": "ns", "uid": "u", "generation": 2}}  # fmt: skip

    def replicas(spec: InferenceGraphSpec) -> int:
        return int(render_router(owner, spec, "{}", "img")["spec"]["replicas"])

    assert replicas(graph_spec(3)) == 3  # not autoscaled: as written
    assert replicas(graph_spec(3, **RPS)) == 3  # written by the autoscaler
    assert replicas(graph_spec(9, **RPS)) == 4  # a hand-made scale past maxReplicas
    assert replicas(graph_spec(1, **{**RPS, "minReplicas": 2})) == 2
    previous = InferenceGraphStatus.model_validate(
        {"autoscaling": {"desiredReplicas": 3, "lastScaleReason": "ScaledUp"}}
    )
    status, _ = compute_status(owner, graph_spec(3, **RPS), Observed(None, {}), previous)
    assert status.autoscaling == previous.autoscaling  # the reconcile pass never clears the autoscaler's status
    assert status.selector == (
        "app.kubernetes.io/component=router,app.kubernetes.io/instance=g,app.kubernetes.io/name=inferencegraph"
    )


def member(name: str, created: str, **server: Any) -> Member:
    return Member(name, f"uid-{name}", created, view_spec(**server))


def test_the_oldest_view_that_autoscales_the_project_server_wins() -> None:
    old = member("a", "2026-01-01T00:00:00Z", replicas=5)
    middle = member("b", "2026-01-02T00:00:00Z", autoscaling=QUERY)
    young = member("c", "2026-01-03T00:00:00Z", autoscaling={**QUERY, "maxReplicas": 9})
    members = [young, old, middle]
    assert project_autoscaling(members) == ("b", middle.spec.server.autoscaling)
    plan = plan_project("rides", members)
    # Autoscaled: the live replicas kept within b's bounds (1..3), minReplicas before the Deployment exists; the
    # fixed replicas of the views (5) no longer count.
    assert [server_replicas(plan, live) for live in (None, 2, 7, 0)] == [1, 2, 3, 1]
    assert render_feature_server("ns", plan, "img", 2)["spec"]["replicas"] == 2
    fixed = plan_project("rides", [old, member("d", "2026-01-04T00:00:00Z", replicas=2)])
    assert server_replicas(fixed, 1) == 5  # not autoscaled: the most any view asks for
    assert project_autoscaling([old]) is None and project_autoscaling([]) is None


# ------------------------------------------------------------------------------------------ one round per kind


def pod(name: str, ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


class FakeApi:
    """Objects by (kind, name) with resourceVersion preconditions on scale and status writes."""

    def __init__(self, objects: list[dict[str, Any]], pods: dict[str, list[dict[str, Any]]]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        self.pods = pods  # label selector fragment -> pods
        self.writes: list[tuple[str, str, str | None, dict[str, Any]]] = []

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    async def list_objects(
        self, api_version: str, kind: str, namespace: str | None, selector: str | None = None
    ) -> list[Any]:
        if kind == "Pod":
            return [p for fragment, pods in self.pods.items() if fragment in (selector or "") for p in pods]
        return [copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind]

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any], **kw: Any
    ) -> dict[str, Any]:
        obj = self.objects[(kind, name)]
        meta = obj["metadata"]
        if body["metadata"]["resourceVersion"] != meta["resourceVersion"]:
            raise kube.Conflict("changed")
        assert kw["field_manager"] == "loom-autoscaler"
        self.writes.append((kind, name, kw.get("subresource"), body))
        if kw.get("subresource") == "scale":
            if kind == "InferenceGraph":
                obj["spec"]["router"]["replicas"] = body["spec"]["replicas"]
            else:
                obj["spec"]["replicas"] = body["spec"]["replicas"]
        else:
            obj.setdefault("status", {}).update(body["status"])
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return {"metadata": {"resourceVersion": meta["resourceVersion"]}}


def prometheus(answer_value: float, now: float, seen: list[str]) -> PrometheusClient:
    def answer(request: httpx.Request) -> httpx.Response:
        query = parse_qs(request.content.decode())["query"][0]
        seen.append(query)
        taken = query.startswith("(min by (pod) (timestamp(")
        if "loom_server_requests_total" in query or taken:
            result = [{"metric": {"pod": "g-router-1-a"}, "value": [now, str(now - 2 if taken else answer_value)]}]
        else:
            result = [{"metric": {}, "value": [now, str(answer_value)]}]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})

    return PrometheusClient("http://prom:9090", client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))


def meta(name: str, rv: str = "10", created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1, "resourceVersion": rv,
            "creationTimestamp": created}  # fmt: skip


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []

    def post(body: dict[str, Any], evs: list[Any]) -> None:
        seen.extend((body["metadata"]["name"], e.type, e.reason) for e in evs)

    monkeypatch.setattr(module, "post_events", post)
    return seen


def install(monkeypatch: pytest.MonkeyPatch, api: FakeApi) -> None:
    for name in ("get", "list_objects", "merge_patch"):
        monkeypatch.setattr(kube, name, getattr(api, name))


async def test_a_router_is_scaled_up_on_its_request_rate_through_the_graphs_scale_subresource(
    monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str, str]]
) -> None:
    graph = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceGraph", "metadata": meta("g"),
             "spec": {"nodes": NODES, "router": {"replicas": 1, "autoscaling": RPS}}}  # fmt: skip
    api = FakeApi([graph], {"app.kubernetes.io/instance=g": [pod("g-router-1-a")]})
    install(monkeypatch, api)
    queries: list[str] = []
    scaler = module.Autoscaler(OperatorSettings(**IMAGE_SETTINGS), adapter=GRAPH_ADAPTER, clock=lambda: 1000.0)
    scaler._prometheus = prometheus(35.0, 1000.0, queries)  # 35 requests/s against 10 per replica
    assert module.autoscaled(graph["spec"], GRAPH_ADAPTER) and not module.autoscaled(graph["spec"], ISVC_ADAPTER)
    await scaler.round([("ns", "g")])
    assert [(k, sub, b["spec"]) for k, _, sub, b in api.writes if sub == "scale"] == [
        ("InferenceGraph", "scale", {"replicas": 4})
    ]
    assert any('pod=~"g-router-1-a"' in q and "loom_server_requests_total" in q for q in queries)
    status = api.objects[("InferenceGraph", "g")]["status"]
    assert (status["autoscaling"]["desiredReplicas"], status["autoscaling"]["metric"]) == (4, "requests-per-second")
    assert status["conditions"][0]["type"] == "MetricsAvailable"
    assert ("g", "Normal", "ScaledUp") in events
    await scaler.stop()


async def test_the_feature_server_is_scaled_by_the_oldest_autoscaled_view_only(
    monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str, str]]
) -> None:
    def view(name: str, created: str) -> dict[str, Any]:
        return {"apiVersion": "loom.dev/v1alpha1", "kind": "FeatureView", "metadata": meta(name, created=created),
                "spec": view_spec(autoscaling=QUERY).model_dump(by_alias=True, exclude_none=True)}  # fmt: skip

    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta("rides-features", rv="77"),
                  "spec": {"replicas": 1}}  # fmt: skip
    older, younger = view("a", "2026-01-01T00:00:00Z"), view("b", "2026-01-02T00:00:00Z")
    api = FakeApi([younger, older, deployment], {"loom.dev/feast-project=rides": [pod("rides-features-1-a")]})
    install(monkeypatch, api)
    queries: list[str] = []
    scaler = module.Autoscaler(OperatorSettings(**IMAGE_SETTINGS), adapter=FEATURE_VIEW, clock=lambda: 1000.0)
    scaler._prometheus = prometheus(120.0, 1000.0, queries)  # the query: 120 against 50 per replica
    await scaler.round([("ns", "a"), ("ns", "b")])
    scale = [(k, n, b) for k, n, sub, b in api.writes if sub == "scale"]
    assert scale == [("Deployment", "rides-features", {"metadata": {"resourceVersion": "77"}, "spec": {"replicas": 3}})]
    assert queries == ["sum(rate(x[1m]))"]  # asked once: for view a; b's autoscaling is not in force
    assert "autoscaling" in api.objects[("FeatureView", "a")]["status"]
    assert "status" not in api.objects[("FeatureView", "b")]
    assert ("a", "Normal", "ScaledUp") in events and not [e for e in events if e[0] == "b"]
    await scaler.stop()
