"""spec.routing.pickerReplicas: one picker serving, the others standing by. The operator's objects (the Lease it
creates, the Role narrowed to that Lease, the pods' identity, probes and a rollout strategy a never-Ready standby
cannot block), the one-pod picker left exactly as it was, and the pod's own probes: live on every pod, ready only on
the one serving."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.traffic.picker import (
    picker_config,
    picker_replicas,
    render_picker,
)
from loom.workloads.picker.app import build_admin_app
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState

OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def rendered(**routing: Any) -> dict[str, dict[str, Any]]:
    spec = admitted(InferenceServiceSpec, {"model": {"uri": "s3://models/chat"}, "runtime": "vllm", "replicas": 3,
                                           "routing": routing})
    config = picker_config(OWNER, spec, "prefix-cache")
    manifests = render_picker(OWNER, "server:t", config, picker_replicas(spec))
    assert manifests[-1]["kind"] == "Deployment"  # applied last: the Lease and the Role exist when its pods start
    return {m["kind"]: m for m in manifests}


def container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    return found


def test_a_standby_gets_a_lease_its_role_and_a_strategy_that_cannot_deadlock() -> None:
    objects = rendered(pickerReplicas=2)
    lease = objects["Lease"]
    assert (lease["apiVersion"], lease["metadata"]["name"], lease["metadata"]["namespace"]) == (
        "coordination.k8s.io/v1", "chat-picker", "ml")
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # deleted with the service
    assert "spec" not in lease  # the pods' to write: an apply of the operator's never touches the holder
    rules = objects["Role"]["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["chat-picker"],
            "verbs": ["get", "update"]} in rules
    assert not any("create" in r["verbs"] for r in rules)  # the operator creates it
    deployment = objects["Deployment"]["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": "100%"}}
    server = container(objects)
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in server["env"]
    config = PickerConfig.from_json(next(e["value"] for e in server["env"] if e["name"] == "LOOM_PICKER_CONFIG"))
    assert config.leader_election is not None and config.leader_election.lease_name == "chat-picker"
    assert config.leader_election.renew_deadline_seconds < config.leader_election.duration_seconds


def test_one_picker_renders_as_before() -> None:
    for routing in ({}, {"pickerReplicas": 1}):
        objects = rendered(**routing)
        assert "Lease" not in objects
        assert objects["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
        deployment = objects["Deployment"]["spec"]
        assert deployment["replicas"] == 1
        assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        server = container(objects)
        assert server["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert [e["name"] for e in server["env"]] == ["LOOM_PICKER_CONFIG"]
        assert PickerConfig.from_json(server["env"][0]["value"]).leader_election is None


def test_picker_replicas_are_bounded() -> None:
    for wrong in (0, 4):
        with pytest.raises(ValidationError, match="pickerReplicas"):
            rendered(pickerReplicas=wrong)


def test_a_standby_is_live_and_not_ready_the_leader_both() -> None:
    config = PickerConfig(namespace="ml", service="chat", pod_selector={"app": "x"})
    leading = {"now": False}
    admin = TestClient(build_admin_app(PickerState(config, PickerMetrics("ml/chat")), lambda: True,
                                       lambda: leading["now"]))
    assert admin.get("/healthz").status_code == 200
    standby = admin.get("/readyz")
    assert (standby.status_code, standby.text) == (503, "standby")
    leading["now"] = True
    assert admin.get("/readyz").status_code == 200
    unlisted = TestClient(build_admin_app(PickerState(config, PickerMetrics("ml/chat")), lambda: False))
    assert unlisted.get("/readyz").status_code == 503 and unlisted.get("/healthz").status_code == 503
