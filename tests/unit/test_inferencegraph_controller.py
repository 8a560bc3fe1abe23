"""The InferenceGraph reconcile pass against an in-memory API server: waits for its services, renders the router
once they exist, reports Ready once the router is available, keeps the last good router when the graph turns
invalid; and the index that maps an InferenceService to the graphs naming it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from loom.devstack.images import IMAGE_SETTINGS
from loom.e2e.stack_images import DISTINCT_IMAGE_SETTINGS, pod_images
from loom.operator.kinds.inferencegraph import controller
from loom.operator.settings import OperatorSettings

Key = tuple[str, str, str | None, str]
GRAPH = ("loom.dev/v1alpha1", "InferenceGraph", "ml", "bot")
SETTINGS = OperatorSettings(**{**IMAGE_SETTINGS, "router_image": "localhost/loom/server:test"})


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.applied: list[str] = []
        self.events: list[tuple[str, str]] = []

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        meta = manifest["metadata"]
        key = (manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        new = copy.deepcopy(manifest)
        new["status"] = self.objects.get(key, {}).get("status", {})
        self.objects[key] = new
        self.applied.append(f"{manifest['kind']}/{meta['name']}")
        return copy.deepcopy(new)

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found else None

    async def list_objects(self, api_version: str, kind: str, namespace: str | None, *_: Any) -> list[dict[str, Any]]:
        wanted = (api_version, kind, namespace)
        return [copy.deepcopy(o) for (a, k, ns, _), o in self.objects.items() if (a, k, ns) == wanted]

    async def patch_status(self, api_version: str, kind: str, ns: str, name: str, status: dict[str, Any]) -> None:
        obj = self.objects[(api_version, kind, ns, name)]
        merged = {**obj.get("status", {}), **status}
        obj["status"] = {k: v for k, v in merged.items() if v is not None}

    def put(self, kind: str, name: str, spec: dict[str, Any], status: dict[str, Any] | None = None) -> None:
        key = ("loom.dev/v1alpha1", kind, "ml", name)
        old = self.objects.get(key)
        generation = 1 if old is None else old["metadata"]["generation"] + 1
        self.objects[key] = {
            "apiVersion": "loom.dev/v1alpha1", "kind": kind,
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": generation},
            "spec": spec, "status": status if status is not None else (old or {}).get("status", {}),
        }  # fmt: skip

    def router_available(self) -> None:
        dep = self.objects[("apps/v1", "Deployment", "ml", "bot-router")]
        dep["status"] = {"replicas": 1, "readyReplicas": 1, "conditions": [{"type": "Available", "status": "True"}]}


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for name in ("apply", "get", "list_objects", "patch_status"):
        monkeypatch.setattr(controller.kube, name, getattr(fake, name))
    monkeypatch.setattr(
        controller.kopf, "event", lambda body, *, type, reason, message: fake.events.append((type, reason))
    )
    return fake


READY = {"conditions": [{"type": "Ready", "status": "True", "reason": "Serving"}]}
SPEC = {"nodes": {"root": {"routerType": "Sequence", "steps": [
    {"serviceName": "a", "dependency": "Hard"}, {"serviceName": "b", "data": "$response", "dependency": "Hard"},
]}}}  # fmt: skip


async def status(api: FakeApi) -> dict[str, Any]:
    await controller.reconcile("ml", "bot", SETTINGS)
    return dict(api.objects[GRAPH]["status"])


def reasons(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["reason"] for c in status["conditions"]}


async def test_waits_for_its_services_then_renders_and_becomes_ready(api: FakeApi) -> None:
    api.put("InferenceGraph", "bot", SPEC)
    api.put("InferenceService", "a", {"model": {"uri": "s3://m/a", "name": "model-a"}}, READY)
    first = await status(api)
    assert reasons(first)["Ready"] == "ServiceNotFound" and api.applied == []
    assert first["phase"] == "Pending" and first["services"] == "1/2"

    api.put("InferenceService", "b", {"model": {"uri": "s3://m/b"}}, READY)
    starting = await status(api)
    assert api.applied == ["ConfigMap/bot-router-config", "Deployment/bot-router", "Service/bot"]
    assert reasons(starting)["Ready"] == "Starting"
    config = api.objects[("v1", "ConfigMap", "ml", "bot-router-config")]["data"]["router.json"]
    assert '"modelName": "model-a"' in config

    api.router_available()
    ready = await status(api)
    assert reasons(ready)["Ready"] == "Serving" and ready["phase"] == "Ready"
    assert ("Warning", "ServiceNotFound") in api.events and ("Normal", "Serving") in api.events


async def test_an_invalid_change_keeps_the_last_good_router(api: FakeApi) -> None:
    api.put("InferenceGraph", "bot", SPEC)
    api.put("InferenceService", "a", {"model": {"uri": "s3://m/a"}}, READY)
    api.put("InferenceService", "b", {"model": {"uri": "s3://m/b"}}, READY)
    await status(api)
    api.router_available()
    good = copy.deepcopy(api.objects[("v1", "ConfigMap", "ml", "bot-router-config")])
    api.applied.clear()

    bad = copy.deepcopy(SPEC)
    bad["nodes"]["root"]["steps"][1]["condition"] = "response.outputs[0"
    api.put("InferenceGraph", "bot", bad)
    after = await status(api)
    assert api.applied == []
    assert api.objects[("v1", "ConfigMap", "ml", "bot-router-config")] == good
    assert reasons(after) == {"GraphValid": "InvalidGraph", "DependenciesReady": "DependenciesReady",
                              "RouterAvailable": "Available", "Ready": "InvalidGraph"}  # fmt: skip
    assert after["phase"] == "Degraded"


def test_services_named_reads_a_raw_spec_without_failing() -> None:
    assert controller.services_named(SPEC) == {"a", "b"}
    assert controller.services_named({"nodes": {"root": {"steps": [{"nodeName": "x"}, "junk"]}}}) == set()
    assert controller.services_named(None) == set()


async def test_a_service_of_the_same_name_owned_by_an_inferenceservice_is_left_alone_and_reported(
    api: FakeApi,
) -> None:
    """An InferenceService `bot` in the namespace already has the Service `bot`: the graph never takes it over (one
    field manager applies both, so each apply would take it back); it says so in Ready and a Warning event."""
    api.put("InferenceService", "a", {"model": {"uri": "s3://m/a"}}, READY)
    api.put("InferenceService", "b", {"model": {"uri": "s3://m/b"}}, READY)
    api.put("InferenceGraph", "bot", SPEC)
    isvc_owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "name": "bot", "uid": "uid-isvc",
                  "controller": True}  # fmt: skip
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "bot", "namespace": "ml", "ownerReferences": [isvc_owner]},
              "spec": {"selector": {"app.kubernetes.io/name": "inferenceservice"}}}  # fmt: skip
    api.objects[("v1", "Service", "ml", "bot")] = copy.deepcopy(theirs)
    got = await status(api)
    assert api.objects[("v1", "Service", "ml", "bot")] == theirs  # untouched
    assert "Service/bot" not in api.applied and "Deployment/bot-router" in api.applied
    ready = next(c for c in got["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ServiceNameConflict")
    assert "InferenceService bot" in ready["message"] and "rename the InferenceGraph" in ready["message"]
    assert ("Warning", "ServiceNameConflict") in api.events

    # The InferenceService goes (its Service with it): the graph applies its own and serves.
    del api.objects[("v1", "Service", "ml", "bot")]
    api.router_available()
    got = await status(api)
    assert "Service/bot" in api.applied and reasons(got)["Ready"] == "Serving"


async def test_the_router_runs_the_router_image_the_operator_was_given(api: FakeApi) -> None:
    """LOOM_ROUTER_IMAGE (the chart's <image.registry>/server) is what the router pods run."""
    api.put("InferenceGraph", "bot", SPEC)
    api.put("InferenceService", "a", {"model": {"uri": "s3://m/a"}}, READY)
    api.put("InferenceService", "b", {"model": {"uri": "s3://m/b"}}, READY)
    await controller.reconcile("ml", "bot", OperatorSettings(**DISTINCT_IMAGE_SETTINGS))
    router = api.objects[("apps/v1", "Deployment", "ml", "bot-router")]
    assert pod_images(router) == {DISTINCT_IMAGE_SETTINGS["router_image"]}


def router_pod(name: str, component: str, reason: str, message: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "inferencegraph", "app.kubernetes.io/instance": "bot",
              "app.kubernetes.io/component": component, "loom.dev/inferencegraph": "bot"}  # fmt: skip
    waiting = {"waiting": {"reason": reason, "message": message}}
    return {
        "metadata": {"name": name, "namespace": "ml", "labels": labels},
        "status": {"containerStatuses": [{"name": "router", "ready": False, "state": waiting}]},
    }


async def test_a_router_pod_that_cannot_start_is_named_from_the_pod_watch_cache(api: FakeApi) -> None:
    """The router's pods come from the pod index handed in (no LIST per pass): a router pod stuck on a missing
    Secret is named in RouterAvailable and Ready, before the services' state; a pod of another component of the
    same graph is not the router's."""
    api.put("InferenceGraph", "bot", SPEC)
    api.put("InferenceService", "a", {"model": {"uri": "s3://m/a"}}, READY)
    api.put("InferenceService", "b", {"model": {"uri": "s3://m/b"}}, READY)
    index = {("ml", "bot"): [router_pod("bot-router-x", "other", "ImagePullBackOff", "no such image")]}
    await controller.reconcile("ml", "bot", SETTINGS, index)
    assert reasons(dict(api.objects[GRAPH]["status"]))["Ready"] == "Starting"

    index[("ml", "bot")].append(
        router_pod("bot-router-y", "router", "CreateContainerConfigError", 'secret "k" not found')
    )
    await controller.reconcile("ml", "bot", SETTINGS, index)
    stuck = dict(api.objects[GRAPH]["status"])
    assert reasons(stuck)["RouterAvailable"] == "CreateContainerConfigError"
    assert reasons(stuck)["Ready"] == "CreateContainerConfigError"
    ready = next(c for c in stuck["conditions"] if c["type"] == "Ready")
    assert 'pod bot-router-y container router: CreateContainerConfigError: secret "k" not found' in ready["message"]
    assert ("Warning", "CreateContainerConfigError") in api.events
