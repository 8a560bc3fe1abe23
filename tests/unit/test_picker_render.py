"""The operator's side of prefix-cache routing: spec.routing, when a service gets a picker, its objects, and the
Service's selector (activator at zero, the replicas until the picker is Ready, then the picker)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from loom.devstack.images import IMAGE_SETTINGS
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import server_selector
from loom.operator.kinds.inferenceservice.rollout import RolloutPlan
from loom.operator.kinds.inferenceservice.traffic import io as controller
from loom.operator.kinds.inferenceservice.traffic.activator import activator_selector
from loom.operator.kinds.inferenceservice.traffic.picker import (
    picker_config,
    picker_policy,
    picker_selector,
    render_picker,
)
from loom.operator.settings import OperatorSettings
from loom.workloads.picker.config import PickerConfig

SETTINGS = OperatorSettings(**IMAGE_SETTINGS)
OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def spec(**fields: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"uri": "s3://models/chat"}, "runtime": "vllm", **fields})


def test_who_gets_a_picker_and_which_policy() -> None:
    assert picker_policy(spec(replicas=3)) == "prefix-cache"  # the default with several replicas
    assert picker_policy(spec(autoscaling={"maxReplicas": 4, "metric": "llm-waiting-requests", "target": 2})) == (
        "prefix-cache")
    assert picker_policy(spec(replicas=1)) is None and picker_policy(spec()) is None
    assert picker_policy(spec(replicas=1, routing={"policy": "round-robin"})) == "round-robin"
    assert picker_policy(spec(replicas=2, routing={})) == "prefix-cache"
    default = InferenceServiceSpec.model_validate({"model": {"uri": "s3://m/x"}, "replicas": 3})
    assert picker_policy(default) is None  # the default runtime has no engine prefix cache to route by


def test_routing_fields_are_checked() -> None:
    with pytest.raises(ValidationError, match="policy"):
        spec(routing={"policy": "random"})
    with pytest.raises(ValidationError, match="header"):
        spec(routing={"sessionAffinity": {"header": "bad header"}})
    with pytest.raises(ValidationError, match="maxKvCacheUsage"):
        spec(routing={"maxKvCacheUsage": 1.5})


def test_the_crds_rule_refuses_routing_without_vllm() -> None:
    import cel

    from loom.operator.api.crd import crd_for
    from loom.operator.api.kinds import INFERENCE_SERVICE

    schema = crd_for(INFERENCE_SERVICE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    [rule] = [r for r in schema["x-kubernetes-validations"] if r["message"] == "routing needs runtime: vllm"]
    program = cel.compile(rule["rule"])
    assert program.execute({"self": {"runtime": "default", "routing": {}}}) is False
    assert program.execute({"self": {"runtime": "vllm", "routing": {}}}) is True
    assert program.execute({"self": {"runtime": "default"}}) is True
    assert set(schema["properties"]["routing"]["properties"]["policy"]["enum"]) == {
        "prefix-cache", "least-loaded", "round-robin"}


def test_the_pickers_objects() -> None:
    s = spec(replicas=3, routing={"sessionAffinity": {"header": "x-session-id"}, "maxWaitingRequests": 4})
    config = picker_config(OWNER, s, "prefix-cache")
    objects = render_picker(OWNER, "registry.example/loom/server:1", config)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "Deployment"]
    assert objects[1]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    pod = objects[3]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert picker_selector(OWNER).items() <= labels.items()
    assert not server_selector(OWNER).items() <= labels.items()  # never counted as a replica
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "loom.workloads.picker"]
    assert container["image"] == "registry.example/loom/server:1"
    rendered = PickerConfig.from_json(container["env"][0]["value"])
    assert (rendered.policy, rendered.session_header, rendered.max_waiting_requests) == (
        "prefix-cache", "x-session-id", 4)
    assert rendered.pod_selector == server_selector(OWNER) and rendered.track_label == "loom.dev/track"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9090"


class FakeKube:
    def __init__(self, picker_ready: int = 0, existing: set[tuple[str, str]] | None = None) -> None:
        self.applied: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.picker_ready = picker_ready
        self.existing = existing or set()

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.applied.append(json.loads(json.dumps(manifest)))
        if manifest["kind"] == "Deployment" and manifest["metadata"]["name"] == "chat-picker":
            return {**manifest, "status": {"readyReplicas": self.picker_ready}}
        return manifest

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return {"kind": kind} if (kind, name) in self.existing else None

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, **_: Any) -> bool:
        self.deleted.append((kind, name))
        return True


READY = {"status": {"readyReplicas": 3}}


async def test_the_service_selects_the_picker_once_it_is_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = RolloutPlan(stable_ref=None, stable_replicas=3)
    fake = FakeKube(picker_ready=0)
    monkeypatch.setattr(controller, "kube", fake)
    await controller.apply_routing(OWNER, spec(replicas=3), plan, READY, None, SETTINGS)
    assert [o["kind"] for o in fake.applied] == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert fake.applied[-1]["spec"]["selector"] == server_selector(OWNER)  # the picker is not Ready yet
    fake = FakeKube(picker_ready=1)
    monkeypatch.setattr(controller, "kube", fake)
    await controller.apply_routing(OWNER, spec(replicas=3), plan, READY, None, SETTINGS)
    assert fake.applied[-1]["spec"]["selector"] == picker_selector(OWNER)
    assert fake.deleted == []


async def test_at_zero_the_activator_holds_and_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(picker_ready=1)
    monkeypatch.setattr(controller, "kube", fake)
    s = spec(autoscaling={"minReplicas": 0, "maxReplicas": 3, "metric": "llm-waiting-requests", "target": 2})
    routed = await controller.apply_routing(OWNER, s, RolloutPlan(stable_ref=None, stable_replicas=0),
                                            {"status": {}}, None, SETTINGS)
    assert routed is True
    assert fake.applied[-1]["spec"]["selector"] == activator_selector(OWNER)
    assert {o["metadata"]["name"] for o in fake.applied if o["kind"] == "Deployment"} == {
        "chat-activator", "chat-picker"}


async def test_a_service_down_to_one_replica_loses_its_picker(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(existing={("Deployment", "chat-picker")})
    monkeypatch.setattr(controller, "kube", fake)
    await controller.apply_routing(OWNER, spec(replicas=1), RolloutPlan(stable_ref=None, stable_replicas=1),
                                   READY, None, SETTINGS)
    assert [o["kind"] for o in fake.applied] == ["Service"]
    assert fake.applied[0]["spec"]["selector"] == server_selector(OWNER)  # turned back first, then deleted
    assert fake.deleted == [("Deployment", "chat-picker"), ("RoleBinding", "chat-picker"), ("Role", "chat-picker"),
                            ("ServiceAccount", "chat-picker")]


def test_a_service_with_adapters_tells_its_picker_the_base_model_and_the_engines_adapter_slots() -> None:
    adapters = [{"name": "pirate", "uri": "s3://adapters/pirate"}]
    config = picker_config(OWNER, spec(replicas=3, adapters=adapters, vllm={"maxLoadedAdapters": 4}), "prefix-cache")
    assert (config.base_model, config.adapter_slots) == ("chat", 4)
    named = spec(replicas=3, adapters=adapters, model={"uri": "s3://models/chat", "name": "llama"})
    config = picker_config(OWNER, named, "least-loaded")
    assert (config.base_model, config.adapter_slots) == ("llama", 1)  # vLLM's default --max-loras
    plain = picker_config(OWNER, spec(replicas=3), "prefix-cache")
    assert plain.base_model is None  # no adapters: every request is for the base model
