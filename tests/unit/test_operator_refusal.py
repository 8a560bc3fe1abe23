"""A child the API server refuses is reported on its object (Ready=False ChildRejected), found by the chaos spec
fuzzer: a FeatureView whose secretRef key Kubernetes does not allow kept failing its pass without any status."""

from __future__ import annotations

import json

from kubernetes_asyncio.client.exceptions import ApiException

from loom.operator.core.client import refusal
from loom.operator.core.refusal import refused_status


def _api_error(status: int, message: str) -> ApiException:
    error = ApiException(status=status, reason="Unprocessable Entity")
    error.body = json.dumps({"kind": "Status", "message": message})
    return error


def test_only_an_invalid_request_is_a_refusal() -> None:
    assert refusal(_api_error(422, 'Deployment.apps "x" is invalid: env[0].name')) == (
        'Deployment.apps "x" is invalid: env[0].name'
    )
    assert refusal(_api_error(400, "error decoding patch")) == "error decoding patch"
    assert refusal(_api_error(500, "etcd down")) is None
    assert refusal(_api_error(409, "conflict")) is None
    assert refusal(RuntimeError("boom")) is None


def test_ready_turns_false_with_the_reason_and_other_conditions_stay() -> None:
    status = {
        "conditions": [
            {"type": "Registered", "status": "Unknown", "reason": "Applying", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Ready", "status": "True", "reason": "Ready", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ]
    }
    patch = refused_status(status, 3, "x" * 5000)
    assert patch["observedGeneration"] == 3
    registered, ready = patch["conditions"]
    assert registered["type"] == "Registered" and registered["reason"] == "Applying"
    assert ready["type"] == "Ready" and ready["status"] == "False" and ready["reason"] == "ChildRejected"
    assert ready["observedGeneration"] == 3 and ready["lastTransitionTime"] != "2026-01-01T00:00:00Z"
    assert ready["message"].startswith("the API server refused an object rendered for this one: xxx")
    assert len(ready["message"]) == 1024
    assert refused_status({}, 1, "m")["conditions"][0]["reason"] == "ChildRejected"
