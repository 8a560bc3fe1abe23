"""The activator's pure parts: config contract, Ready endpoints, the wake patch, header forwarding."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from loom.workloads.activator.config import ActivatorConfig
from loom.workloads.activator.kube import wake_patch
from loom.workloads.activator.proxy import end_to_end, request_headers
from loom.workloads.activator.targets import Targets, ready_endpoints


def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-23T12:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_config_round_trips_and_refuses_bad_values() -> None:
    cfg = ActivatorConfig(namespace="ml", service="chat", pod_selector={"b": "2", "a": "1"}, timeout_seconds=7)
    again = ActivatorConfig.from_json(cfg.to_json())
    assert again == cfg
    assert '"timeoutSeconds":7.0' in cfg.to_json()
    assert cfg.selector_string() == "a=1,b=2"
    with pytest.raises(ValidationError):
        ActivatorConfig(namespace="ml", service="chat", pod_selector={"a": "1"}, timeout_seconds=0)
    with pytest.raises(ValidationError):
        ActivatorConfig(namespace="ml", service="chat", pod_selector={})  # would select every pod


def test_only_ready_pods_with_an_ip_that_are_not_terminating_are_targets() -> None:
    pods = [
        pod("a", "10.0.0.2", ready=True),
        pod("b", "10.0.0.1", ready=True),
        pod("c", "10.0.0.3", ready=False),  # still loading its model
        pod("d", "10.0.0.4", ready=True, deleting=True),  # draining: takes nothing new
        pod("e", None, ready=True),
        pod("f", "fd00::5", ready=True),
        {"metadata": {"name": "g"}},  # no status yet
    ]
    assert ready_endpoints(pods, 8080) == ("10.0.0.1:8080", "10.0.0.2:8080", "[fd00::5]:8080")


async def test_targets_round_robin_wait_and_forget() -> None:
    targets = Targets()
    assert targets.pick() is None
    assert await targets.wait(0.01) is False
    targets.set(["a:1", "b:1"])
    assert await targets.wait(0) is True
    assert {targets.pick(), targets.pick()} == {"a:1", "b:1"}
    targets.forget("a:1")
    assert targets.endpoints == ("b:1",)
    targets.forget("b:1")
    assert await targets.wait(0.01) is False


def test_wake_patch_asks_for_one_replica_only_at_zero_with_the_version_read_as_precondition() -> None:
    at_zero = {"metadata": {"resourceVersion": "42"}, "spec": {"replicas": 0}}
    assert wake_patch(at_zero) == {"metadata": {"resourceVersion": "42"}, "spec": {"replicas": 1}}
    never_written = {"metadata": {"resourceVersion": "7"}, "spec": {}}
    assert wake_patch(never_written) is not None
    assert wake_patch({"metadata": {"resourceVersion": "9"}, "spec": {"replicas": 2}}) is None


def test_hop_by_hop_headers_stay_behind() -> None:
    headers = [
        ("Host", "chat.ml.svc"),
        ("Connection", "keep-alive, X-Private"),
        ("X-Private", "1"),
        ("Keep-Alive", "timeout=5"),
        ("Transfer-Encoding", "chunked"),
        ("Content-Length", "12"),
        ("Authorization", "Bearer k"),
        ("X-Forwarded-For", "10.1.1.1"),
        ("traceparent", "00-abc"),
    ]
    out = request_headers(headers, "10.2.2.2")
    assert out == [
        ("Authorization", "Bearer k"),
        ("traceparent", "00-abc"),
        ("x-forwarded-for", "10.1.1.1, 10.2.2.2"),
    ]
    # Answers keep their framing length (bodies are relayed byte for byte, never decompressed).
    assert end_to_end([("Content-Length", "3"), ("Set-Cookie", "a"), ("Set-Cookie", "b"), ("TE", "x")]) == [
        ("Content-Length", "3"),
        ("Set-Cookie", "a"),
        ("Set-Cookie", "b"),
    ]
