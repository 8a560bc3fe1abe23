"""The router Deployment's drain: the preStop sleep, the router's SIGTERM drain flags, and a grace period that
covers them plus the longest graph request (the deadline) and the exit."""

from __future__ import annotations

from typing import Any

from loom.operator.kinds.inferencegraph.api import InferenceGraphSpec
from loom.operator.kinds.inferencegraph.render import render_deployment

OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceGraph",
         "metadata": {"name": "bot", "namespace": "ns", "uid": "u"}}  # fmt: skip
NODES = {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}


def deployment(**router: Any) -> dict[str, Any]:
    spec = InferenceGraphSpec.model_validate({"nodes": NODES, "router": router})
    return render_deployment(OWNER, spec, "{}", "loom/server:test")


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_a_removed_router_drains_within_its_grace_period() -> None:
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    command = container["command"]
    assert _flag(command, "--drain-seconds") == "6"  # as the model server: longer than clients' idle pools
    assert _flag(command, "--shutdown-timeout") == "61"  # the default 60 s graph deadline, rounded up
    # preStop 5 + drain 6 + requests in flight 61 + 2 to exit
    assert pod["terminationGracePeriodSeconds"] == 74


def test_a_longer_step_timeout_lengthens_the_grace_period() -> None:
    pod = deployment(timeoutMs=120_000)["spec"]["template"]["spec"]
    assert _flag(pod["containers"][0]["command"], "--shutdown-timeout") == "121"
    assert pod["terminationGracePeriodSeconds"] == 5 + 6 + 121 + 2
