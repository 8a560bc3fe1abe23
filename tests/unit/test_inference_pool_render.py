"""spec.routing.inferencePool: the InferencePool (GIE, inference.networking.k8s.io/v1) and the picker's gRPC Service
a routed vllm service renders, whose pool is whose, and what status says (traffic/pool.py, traffic/io.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from loom.devstack.images import IMAGE_SETTINGS
from loom.operator.core.client import NotFound
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import SERVER_PORT, server_selector
from loom.operator.kinds.inferenceservice.traffic import io
from loom.operator.kinds.inferenceservice.traffic.picker import (
    EXT_PROC_PORT,
    picker_config,
    picker_selector,
    render_picker,
)
from loom.operator.kinds.inferenceservice.traffic.pool import (
    ownership,
    pool_condition,
    render_inference_pool,
    render_picker_service,
)
from loom.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(**IMAGE_SETTINGS)
OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def spec(**routing: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"uri": "s3://models/chat"}, "runtime": "vllm",
                                                "replicas": 3, "routing": routing})


def test_the_pool_selects_the_replicas_and_names_the_pickers_grpc_service() -> None:
    pool = render_inference_pool(OWNER, "FailOpen")
    assert (pool["apiVersion"], pool["kind"], pool["metadata"]["name"]) == (
        "inference.networking.k8s.io/v1", "InferencePool", "chat")
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pool["spec"] == {
        "selector": {"matchLabels": server_selector(OWNER)},
        "targetPorts": [{"number": SERVER_PORT}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "chat-picker",
                              "port": {"number": EXT_PROC_PORT}, "failureMode": "FailOpen"},
    }
    service = render_picker_service(OWNER)
    assert service["metadata"]["name"] == "chat-picker"
    assert service["spec"]["selector"] == picker_selector(OWNER)
    assert service["spec"]["ports"] == [{"name": "grpc", "port": EXT_PROC_PORT, "targetPort": "grpc",
                                         "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]


def test_the_picker_listens_for_ext_proc_only_with_a_pool() -> None:
    with_pool = picker_config(OWNER, spec(inferencePool={}), "prefix-cache")
    assert with_pool.ext_proc_port == EXT_PROC_PORT
    container = render_picker(OWNER, SETTINGS.server_image, with_pool)[-1]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": EXT_PROC_PORT, "protocol": "TCP"} in container["ports"]
    without = picker_config(OWNER, spec(), "prefix-cache")
    assert without.ext_proc_port is None
    container = render_picker(OWNER, SETTINGS.server_image, without)[-1]["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["http", "admin"]


def test_failure_mode_defaults_to_fail_close_and_is_checked() -> None:
    routing = spec(inferencePool={}).routing
    assert routing is not None and routing.inference_pool is not None
    assert routing.inference_pool.failure_mode == "FailClose"
    with pytest.raises(ValidationError, match="failureMode"):
        spec(inferencePool={"failureMode": "FailSometimes"})


def test_a_pool_is_ours_only_by_our_controller_reference() -> None:
    assert ownership(None, OWNER) == "absent"
    assert ownership(render_inference_pool(OWNER, "FailClose"), OWNER) == "ours"
    users = {"metadata": {"name": "chat", "namespace": "ml"}}
    assert ownership(users, OWNER) == "theirs"
    namesake = render_inference_pool({**OWNER, "metadata": {**OWNER["metadata"], "uid": "u-old"}}, "FailClose")
    assert ownership(namesake, OWNER) == "theirs"  # an earlier service of the same name: not this one's
    ok, reason, message = pool_condition("chat", "theirs")
    assert (ok, reason) == (False, "NotOwned") and "not made by this InferenceService" in message
    assert pool_condition("chat", "absent")[:2] == (True, "Applied")


class FakeKube:
    """The operator client's calls apply_pool makes; `pool`: the InferencePool under the name; `crd`: served."""

    NotFound = NotFound

    def __init__(self, pool: dict[str, Any] | None = None, crd: bool = True) -> None:
        self.pool, self.crd = pool, crd
        self.applied: list[str] = []
        self.deleted: list[tuple[str, str, str | None]] = []

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        if manifest["kind"] == "InferencePool" and not self.crd:
            raise NotFound("/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools/chat")
        self.applied.append(manifest["kind"])
        return manifest

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pool if kind == "InferencePool" else None

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None,
                     **_: Any) -> bool:
        self.deleted.append((kind, name, uid))
        return True


async def test_apply_pool_writes_ours_never_theirs_and_says_when_the_kind_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wanted = spec(inferencePool={})
    for pool, crd, found, applied in [
        (None, True, "absent", ["Service", "InferencePool"]),
        (render_inference_pool(OWNER, "FailClose"), True, "ours", ["Service", "InferencePool"]),
        ({"metadata": {"name": "chat", "uid": "theirs"}}, True, "theirs", ["Service"]),
        (None, False, "no_crd", ["Service"]),
    ]:
        fake = FakeKube(pool, crd)
        monkeypatch.setattr(io, "kube", fake)
        assert await io.apply_pool(OWNER, wanted, had_pool=False) == found
        assert fake.applied == applied and not fake.deleted
    assert pool_condition("chat", "no_crd")[:2] == (False, "CRDNotInstalled")


async def test_a_pool_no_longer_asked_for_goes_only_if_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = {**render_inference_pool(OWNER, "FailClose")}
    ours["metadata"] = {**ours["metadata"], "uid": "pool-uid"}
    fake = FakeKube(ours)
    monkeypatch.setattr(io, "kube", fake)
    assert await io.apply_pool(OWNER, spec(), had_pool=True) is None
    assert fake.deleted == [("InferencePool", "chat", "pool-uid"), ("Service", "chat-picker", None)]
    fake = FakeKube({"metadata": {"name": "chat", "uid": "theirs"}})
    monkeypatch.setattr(io, "kube", fake)
    await io.apply_pool(OWNER, spec(), had_pool=True)
    assert fake.deleted == [("Service", "chat-picker", None)]  # the user's pool stays
    fake = FakeKube(ours)
    monkeypatch.setattr(io, "kube", fake)
    await io.apply_pool(OWNER, spec(), had_pool=False)
    assert fake.deleted == []  # it never named one in status: nothing to clean up
