"""Kueue in the local stack: what of its chart is applied, and how the host-run controller is configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.devstack.cluster import kueue
from loom.devstack.cluster.egress import resolve


def webhook(name: str, group: str) -> dict[str, Any]:
    return {"name": name, "rules": [{"apiGroups": [group], "resources": ["x"]}]}


RENDERED: list[dict[str, Any]] = [
    {"kind": "CustomResourceDefinition", "metadata": {"name": "workloads.kueue.x-k8s.io"}},
    {"kind": "Secret", "metadata": {"name": "kueue-webhook-server-cert"}},
    {"kind": "Deployment", "metadata": {"name": "kueue-controller-manager"}},
    {"kind": "APIService", "metadata": {"name": "v1beta2.visibility.kueue.x-k8s.io"}},
    {"kind": "ClusterRole", "metadata": {"name": "kueue-manager-role"}},
    {
        "kind": "Service",
        "metadata": {"name": "kueue-webhook-service"},
        "spec": {"ports": [{"port": 443, "targetPort": 9443}], "selector": {"control-plane": "controller-manager"}},
    },
    {"kind": "Service", "metadata": {"name": "kueue-visibility-server"}, "spec": {}},
    {
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "kueue-mutating-webhook-configuration"},
        "webhooks": [
            webhook("mpod.kb.io", ""),
            webhook("mjob.kb.io", "batch"),
            webhook("mworkload.kb.io", "kueue.x-k8s.io"),
        ],
    },
]


def test_only_kueues_own_api_is_served_by_its_webhooks_and_nothing_runs_in_a_pod() -> None:
    selected = kueue.CONTROLLER.select(RENDERED)
    kinds = [(d["kind"], d["metadata"]["name"]) for d in selected]
    assert kinds == [
        ("Namespace", "kueue-system"),
        ("CustomResourceDefinition", "workloads.kueue.x-k8s.io"),
        ("Secret", "kueue-webhook-server-cert"),
        ("Service", "kueue-webhook-service"),
        ("MutatingWebhookConfiguration", "kueue-mutating-webhook-configuration"),
    ]
    # Pods, Jobs, Deployments never wait on Kueue's webhooks (they fail closed).
    assert [w["name"] for w in selected[-1]["webhooks"]] == ["mworkload.kb.io"]
    service = selected[3]
    assert "selector" not in service["spec"] and service["spec"]["ports"] == [{"port": 443, "targetPort": 9443}]


def test_the_host_process_binds_loopback_and_queues_trainingjobs(tmp_path: Path) -> None:
    config = kueue.CONTROLLER.configuration(40001, 40002, tmp_path)
    assert config["webhook"] == {"host": "127.0.0.1", "port": 40001, "certDir": str(tmp_path)}
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:40002"
    assert config["metrics"]["bindAddress"] == "0"
    assert config["internalCertManagement"]["enable"] is True
    assert config["integrations"]["externalFrameworks"] == [
        "TrainingJob.v1alpha1.loom.dev",
        "InferenceService.v1alpha1.loom.dev",
    ]
    assert config["featureGates"]["VisibilityOnDemand"] is False
    assert config["leaderElection"] == {"leaderElect": False}


def test_the_api_server_reaches_the_webhook_service_at_the_host_port() -> None:
    services = kueue.CONTROLLER.host_services("10.96.3.4", 40001)
    assert resolve("10.96.3.4", 443, services) == ("127.0.0.1", 40001)
