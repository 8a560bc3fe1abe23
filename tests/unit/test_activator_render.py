"""The operator's side of scale to zero: the activator's objects, least-privilege Role, and the Service's routing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loom.devstack.images import IMAGE_SETTINGS
from loom.e2e.stack_images import DISTINCT_IMAGE_SETTINGS, pod_images
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import server_selector
from loom.operator.kinds.inferenceservice.rollout import RolloutPlan, desired_total_replicas
from loom.operator.kinds.inferenceservice.traffic import io as controller
from loom.operator.kinds.inferenceservice.traffic.activator import (
    activator_config,
    activator_enabled,
    activator_selector,
    render_activator,
    render_routed_service,
    routes_to_activator,
)
from loom.operator.settings import OperatorSettings
from loom.workloads.activator.config import ActivatorConfig

SETTINGS = OperatorSettings(**IMAGE_SETTINGS)
OWNER = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"},
}


def spec(**autoscaling: Any) -> InferenceServiceSpec:
    body: dict[str, Any] = {"model": {"uri": "s3://models/chat"}, "handler": "noop"}
    if autoscaling:
        body["autoscaling"] = {"maxReplicas": 3, "target": 2, "metric": "queue-depth", **autoscaling}
    return InferenceServiceSpec.model_validate(body)


def test_only_a_builtin_autoscaled_service_allowed_to_reach_zero_gets_an_activator() -> None:
    assert activator_enabled(spec(minReplicas=0, idleSeconds=30))
    assert not activator_enabled(spec(minReplicas=1))
    assert not activator_enabled(spec(minReplicas=0, engine="keda"))  # KEDA scales to zero itself
    assert not activator_enabled(spec())


def test_a_service_allowed_to_reach_zero_starts_with_one_replica() -> None:
    assert desired_total_replicas(spec(minReplicas=0)) == 1
    assert desired_total_replicas(spec(minReplicas=0), recommendation=0) == 0  # the autoscaler's decision


@pytest.mark.parametrize(
    ("enabled", "wanted", "ready", "expected"),
    [
        (True, 0, 0, True),  # at zero
        (True, 0, 1, True),  # going to zero: the last replica drains, new requests are held
        (True, 1, 0, True),  # waking (or loading)
        (True, 1, 1, False),  # serving: no extra hop
        (False, 0, 0, False),
    ],
)
def test_routing(enabled: bool, wanted: int, ready: int, expected: bool) -> None:
    assert routes_to_activator(enabled, wanted, ready) is expected


def test_the_service_selects_the_activator_or_the_servers_never_both() -> None:
    to_servers = render_routed_service(OWNER, False)
    to_activator = render_routed_service(OWNER, True)
    assert to_servers["spec"]["selector"] == server_selector(OWNER)
    assert to_activator["spec"]["selector"] == activator_selector(OWNER)
    assert to_activator["spec"]["ports"] == to_servers["spec"]["ports"]  # both on the port named http
    assert to_activator["metadata"]["name"] == "chat"


def test_activator_objects_and_least_privilege() -> None:
    config = activator_config(OWNER, timeout_seconds=30, max_held=50)
    account, role, binding, deployment = render_activator(OWNER, "loom/server:9", config)
    assert [o["kind"] for o in (account, role, binding, deployment)] == [
        "ServiceAccount", "Role", "RoleBinding", "Deployment",
    ]  # fmt: skip
    for obj in (account, role, binding, deployment):
        assert obj["metadata"]["name"] == "chat-activator"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert role["rules"] == [
        {"apiGroups": ["loom.dev"], "resources": ["inferenceservices"], "resourceNames": ["chat"], "verbs": ["get"]},
        {"apiGroups": ["loom.dev"], "resources": ["inferenceservices/scale"], "resourceNames": ["chat"],
         "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    ]  # fmt: skip
    assert binding["roleRef"]["name"] == "chat-activator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-activator", "namespace": "ml"}]
    pod = deployment["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "chat-activator"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "activator"
    # Its pods never match the servers' selector (the autoscaler and the status count only model servers).
    assert not server_selector(OWNER).items() <= pod["metadata"]["labels"].items()
    assert activator_selector(OWNER).items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "loom.workloads.activator"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8080, "admin": 9090}
    rendered = ActivatorConfig.from_json(container["env"][0]["value"])
    assert (rendered.namespace, rendered.service, rendered.timeout_seconds, rendered.max_held) == ("ml", "chat", 30, 50)
    assert rendered.pod_selector == server_selector(OWNER)
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9090"


class FakeKube:
    def __init__(self, existing: set[tuple[str, str]] | None = None) -> None:
        self.applied: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.existing = existing or set()

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.applied.append(json.loads(json.dumps(manifest)))
        return manifest

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return {"kind": kind} if (kind, name) in self.existing else None

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, **_: Any) -> bool:
        self.deleted.append((kind, name))
        return True


def deployment(ready: int) -> dict[str, Any]:
    return {"status": {"readyReplicas": ready}}


async def test_apply_routing_with_the_activator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube()
    monkeypatch.setattr(controller, "kube", fake)
    plan = RolloutPlan(stable_ref=None, stable_replicas=0)
    settings = OperatorSettings(**IMAGE_SETTINGS, activator_timeout_s=15)
    routed = await controller.apply_routing(OWNER, spec(minReplicas=0), plan, deployment(1), None, settings)
    assert routed is True
    assert [o["kind"] for o in fake.applied] == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert fake.applied[-1]["spec"]["selector"] == activator_selector(OWNER)
    env = fake.applied[3]["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"]
    assert ActivatorConfig.from_json(env).timeout_seconds == 15
    # One replica asked for and Ready: straight to the servers.
    fake.applied.clear()
    plan = RolloutPlan(stable_ref=None, stable_replicas=1)
    assert await controller.apply_routing(OWNER, spec(minReplicas=0), plan, deployment(1), None, settings) is False
    assert fake.applied[-1]["spec"]["selector"] == server_selector(OWNER)
    assert fake.deleted == []


async def test_a_service_that_stops_scaling_to_zero_loses_its_activator_after_the_service_turned_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeKube(existing={("Deployment", "chat-activator")})
    monkeypatch.setattr(controller, "kube", fake)
    plan = RolloutPlan(stable_ref=None, stable_replicas=1)
    routed = await controller.apply_routing(OWNER, spec(minReplicas=1), plan, deployment(0), None, SETTINGS)
    assert routed is False
    assert [o["kind"] for o in fake.applied] == ["Service"]
    assert fake.applied[0]["spec"]["selector"] == server_selector(OWNER)
    assert fake.deleted == [
        ("Deployment", "chat-activator"), ("RoleBinding", "chat-activator"), ("Role", "chat-activator"),
        ("ServiceAccount", "chat-activator"),
    ]  # fmt: skip
    # Without an activator there is nothing to delete (no call beyond one read).
    fake = FakeKube()
    monkeypatch.setattr(controller, "kube", fake)
    await controller.apply_routing(OWNER, spec(minReplicas=1), plan, deployment(1), None, SETTINGS)
    assert fake.deleted == []


async def test_the_activator_runs_the_server_image_the_operator_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOOM_SERVER_IMAGE (the chart's <image.registry>/server) is what the scale-to-zero activator runs."""
    fake = FakeKube()
    monkeypatch.setattr(controller, "kube", fake)
    settings = OperatorSettings(**DISTINCT_IMAGE_SETTINGS)
    plan = RolloutPlan(stable_ref=None, stable_replicas=0)
    assert await controller.apply_routing(OWNER, spec(minReplicas=0), plan, deployment(0), None, settings) is True
    [activator] = [o for o in fake.applied if o["kind"] == "Deployment"]
    assert pod_images(activator) == {DISTINCT_IMAGE_SETTINGS["server_image"]}
