"""GIE's conformance suite with Loom's picker (devstack/gie_conformance.py): the pure parts, i.e. the suite's base
manifests rewritten to run Loom's picker and the reading of the suite's `go test -v` output. The suite itself (a Go
test binary) runs only through `python -m loom.devstack.gie_conformance`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from loom.devstack.gie_conformance import GATEWAY_API_VERSION, gateway_class, loom_picker_base, parse_output
from loom.workloads.picker.config import ENV_VAR, PickerConfig

# The suite's wiring (conformance/resources/base.yaml of GIE v1.1.0), cut to what the rewrite reads: a pool, the
# Service its endpointPickerRef names, the epp Deployment that Service selects, and a model-server Deployment.
BASE = """\
apiVersion: v1
kind: Namespace
metadata: {name: inference-conformance-app-backend}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: primary-inference-model-server-deployment, namespace: inference-conformance-app-backend}
spec:
  selector: {matchLabels: {app: primary-inference-model-server}}
  template:
    metadata: {labels: {app: primary-inference-model-server}}
    spec:
      containers:
      - {name: echoserver, image: gcr.example/echo-basic:v1, ports: [{containerPort: 3000}]}
---
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: primary-inference-pool, namespace: inference-conformance-app-backend}
spec:
  selector: {matchLabels: {app: primary-inference-model-server}}
  targetPorts: [{number: 3000}]
  endpointPickerRef: {name: primary-endpoint-picker-svc, port: {number: 9002}}
---
apiVersion: v1
kind: Service
metadata: {name: primary-endpoint-picker-svc, namespace: inference-conformance-app-backend}
spec:
  selector: {app: primary-app-backend-epp}
  ports: [{protocol: TCP, port: 9002, targetPort: 9002, appProtocol: http2}]
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: primary-app-endpoint-picker
  namespace: inference-conformance-app-backend
  labels: {app: primary-app-backend-epp}
spec:
  selector: {matchLabels: {app: primary-app-backend-epp}}
  template:
    metadata: {labels: {app: primary-app-backend-epp}}
    spec:
      terminationGracePeriodSeconds: 130
      containers:
      - name: epp
        image: registry.example/gateway-api-inference-extension/epp:v1.1.0
        args: [--pool-name, primary-inference-pool, --grpc-port, "9002", --grpc-health-port, "9003"]
        volumeMounts: [{name: plugins-config-volume, mountPath: /config}]
      volumes: [{name: plugins-config-volume, configMap: {name: plugins-config}}]
"""


def _by_name(text: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(text) if d}


def test_the_endpoint_picker_deployment_runs_loom_picker_for_its_pool() -> None:
    out = _by_name(loom_picker_base(BASE, "localhost/loom/server:0.1.0"))
    pod = out["primary-app-endpoint-picker"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["image"] == "localhost/loom/server:0.1.0"
    assert container["command"] == ["python", "-m", "loom.workloads.picker"]
    [env] = container["env"]
    assert env["name"] == ENV_VAR
    config = PickerConfig.model_validate_json(env["value"])
    # The pool's own selector, port and picker port: the picker routes to exactly the pods the pool names.
    assert config.namespace == "inference-conformance-app-backend"
    assert config.pod_selector == {"app": "primary-inference-model-server"}
    assert config.target_port == 3000
    assert config.ext_proc_port == 9002
    # GIE's probes (gRPC health, the name GIE's chart asks), on the picker's one gRPC port.
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": 9002, "service": "inference-extension"}
    assert "volumes" not in pod["spec"]  # the epp's plugins file is not mounted any more
    # What the suite relies on stays: the Deployment's pod labels (its Service's selector), its grace period.
    assert pod["metadata"]["labels"] == {"app": "primary-app-backend-epp"}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 130


def test_everything_else_is_left_as_the_suite_wrote_it() -> None:
    before, after = _by_name(BASE), _by_name(loom_picker_base(BASE, "img:1"))
    assert before.keys() == after.keys()
    for name in before.keys() - {"primary-app-endpoint-picker"}:
        assert after[name] == before[name]


def test_the_output_has_no_yaml_aliases() -> None:
    # The suite's Go YAML reader would have to resolve them; plain objects are what the suite's own file has.
    assert "&id" not in loom_picker_base(BASE, "img:1")


def test_a_pool_with_two_target_ports_is_refused() -> None:
    two_ports = BASE.replace("targetPorts: [{number: 3000}]", "targetPorts: [{number: 3000}, {number: 3001}]")
    with pytest.raises(ValueError, match="one target port"):
        loom_picker_base(two_ports, "img:1")


def test_manifests_without_a_picker_deployment_are_refused() -> None:
    no_picker = "\n---\n".join(BASE.split("\n---\n")[:4])  # the pool and its Service, no Deployment behind it
    with pytest.raises(ValueError, match="no endpoint-picker Deployment"):
        loom_picker_base(no_picker, "img:1")


# The suite's own output on the local stack (2026-11-29), abridged: no GatewayClass named gateway-conformance.
NO_GATEWAY_CLASS = (
    "=== RUN   TestConformance\n"
    "    conformance.go:188: Running Inference Extension conformance tests with GatewayClass gateway-conformance\n"
    "    conformance.go:249: 2026-11-29T03:45:26.84356108Z: Test Setup: Ensuring GatewayClass has been accepted\n"
    "    helpers.go:77: \n"
    "        \tError Trace:\t/root/go/pkg/mod/sigs.k8s.io/gateway-api@v1.4.0/conformance/utils/kubernetes"
    "/helpers.go:110\n"
    "        \tError:      \tReceived unexpected error:\n"
    "        \t            \terror fetching GatewayClass: gatewayclasses.gateway.networking.k8s.io"
    ' "gateway-conformance" not found\n'
    "        \tTest:       \tTestConformance\n"
    "        \tMessages:   \terror waiting for gateway-conformance GatewayClass to have Accepted condition to be set\n"
    "--- FAIL: TestConformance (0.67s)\n"
    "FAIL\n"
)


def test_a_setup_failure_is_read_with_its_own_words() -> None:
    outcome = parse_output(NO_GATEWAY_CLASS.splitlines(keepends=True))
    summary = outcome.summary()
    assert summary["suite"] == "FAIL"
    assert summary["setup_reached"] == ["Ensuring GatewayClass has been accepted"]
    assert summary["tests_passed"] == summary["tests_failed"] == summary["tests_skipped"] == []
    [error] = summary["errors"]
    assert error.startswith("Error: Received unexpected error: error fetching GatewayClass:")
    assert '"gateway-conformance" not found' in error
    assert error.endswith("| Messages: error waiting for gateway-conformance GatewayClass to have Accepted "
                          "condition to be set")
    json.dumps(summary)  # printed as JSON by the script


def test_each_test_result_and_each_failed_assertion_is_read() -> None:
    output = """\
=== RUN   TestConformance
    conformance.go:249: Test Setup: Ensuring GatewayClass has been accepted
    conformance.go:255: Test Setup: Applying base manifests
=== RUN   TestConformance/InferencePoolAccepted
=== RUN   TestConformance/GatewayFollowingEPPRouting
        \tError:      \tShould be true
        \tMessages:   \tresponse came from the wrong pod
=== RUN   TestConformance/EppUnAvailableFailOpen
    --- PASS: TestConformance/InferencePoolAccepted (1.20s)
    --- FAIL: TestConformance/GatewayFollowingEPPRouting (30.00s)
    --- SKIP: TestConformance/EppUnAvailableFailOpen (0.00s)
--- FAIL: TestConformance (31.20s)
"""
    summary = parse_output(output.splitlines()).summary()
    assert summary["setup_reached"] == ["Ensuring GatewayClass has been accepted", "Applying base manifests"]
    assert summary["tests_passed"] == ["TestConformance/InferencePoolAccepted"]
    assert summary["tests_failed"] == ["TestConformance/GatewayFollowingEPPRouting"]
    assert summary["tests_skipped"] == ["TestConformance/EppUnAvailableFailOpen"]
    assert summary["errors"] == ["Error: Should be true | Messages: response came from the wrong pod"]


def test_the_gateway_class_names_only_its_controller() -> None:
    # Created without status: only the controller it names can set Accepted (nothing here does).
    manifest = gateway_class("gateway-conformance", "example.net/gateway-controller")
    assert manifest == {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                        "metadata": {"name": "gateway-conformance"},
                        "spec": {"controllerName": "example.net/gateway-controller"}}
    assert GATEWAY_API_VERSION == "v1.4.0"  # what GIE v1.1.0's go.mod requires; the suite refuses any other
