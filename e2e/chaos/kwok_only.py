"""Keep a namespace's pods off the node agent: a ValidatingAdmissionPolicy (CEL, built into the API server) that
refuses every pod there without the kwok toleration. Fuzzed objects whose pods are not placed by their spec
(InferenceGraph routers, FeatureView Jobs and servers) then never start real processes on this machine; the
controllers see the refusal (FailedCreate) and must report it like any other."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import KWOK_TOLERATION

MESSAGE = "chaos: pods in this namespace run on kwok nodes only"


def _policy(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                ]
            },
            "validations": [
                {
                    "expression": "has(object.spec.tolerations) && object.spec.tolerations.exists(t, "
                    f"has(t.key) && t.key == '{KWOK_TOLERATION['key']}')",
                    "message": MESSAGE,
                }
            ],
        },
    }


def _binding(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}},
        },
    }


def _probe_refused(core: client.CoreV1Api, namespace: str) -> bool:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kwok-only-probe"},
           "spec": {"containers": [{"name": "c", "image": "none"}]}}
    try:
        core.create_namespaced_pod(namespace, pod, dry_run="All")
    except ApiException as error:
        return MESSAGE in str(error.body)  # 422 Invalid: the policy's denial
    return False


@contextlib.contextmanager
def kwok_only(api: client.ApiClient, namespace: str) -> Iterator[None]:
    """Within the block, pods in `namespace` without the kwok toleration are refused (checked before yielding)."""
    name = f"loom-chaos-kwok-only-{namespace}"
    admission = client.AdmissionregistrationV1Api(api)
    admission.create_validating_admission_policy(_policy(name))
    try:
        admission.create_validating_admission_policy_binding(_binding(name, namespace))
        try:
            # The API server compiles and starts enforcing a new policy asynchronously.
            core = client.CoreV1Api(api)
            wait_until(lambda: _probe_refused(core, namespace), timeout=30, what="the kwok-only policy")
            yield
        finally:
            admission.delete_validating_admission_policy_binding(name)
    finally:
        admission.delete_validating_admission_policy(name)
