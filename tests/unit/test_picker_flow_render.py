"""spec.routing.flowControl -> the picker's FlowControlConfig (traffic/picker.picker_config): rendered only when set,
checked at the API (bounds, header names), and read back by the picker from its rendered JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.traffic.picker import picker_config
from loom.workloads.picker.config import PickerConfig

OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def spec(**routing: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {"model": {"uri": "s3://models/chat"}, "runtime": "vllm", "replicas": 2, "routing": routing})


def test_flow_control_reaches_the_picker_config() -> None:
    flow = {"maxInflightPerReplica": 4, "maxQueued": 50, "maxQueueWaitSeconds": 5, "tenantHeader": "x-tenant",
            "defaultPriority": -1, "tenantPriorities": {"gold": 10}}
    config = picker_config(OWNER, spec(flowControl=flow), "prefix-cache")
    assert config.flow_control is not None
    assert config.flow_control.max_inflight_per_replica == 4
    assert config.flow_control.tenant_priorities == {"gold": 10}
    assert config.flow_control.priority_header == "x-loom-priority"
    again = PickerConfig.from_json(config.to_json())
    assert again == config
    assert json.loads(config.to_json())["flowControl"]["maxQueueWaitSeconds"] == 5


def test_without_flow_control_nothing_is_rendered() -> None:
    assert picker_config(OWNER, spec(), "prefix-cache").flow_control is None


def test_flow_control_fields_are_checked() -> None:
    with pytest.raises(ValidationError, match="maxInflightPerReplica"):
        spec(flowControl={})
    with pytest.raises(ValidationError, match="maxInflightPerReplica"):
        spec(flowControl={"maxInflightPerReplica": 0})
    with pytest.raises(ValidationError, match="priorityHeader"):
        spec(flowControl={"maxInflightPerReplica": 1, "priorityHeader": "bad header"})
    with pytest.raises(ValidationError, match="tenantPriorities"):
        spec(flowControl={"maxInflightPerReplica": 1, "tenantPriorities": {"gold": 5000}})
