"""LeaderWorkerSet in the local stack: what of its chart is applied (host_webhook.py, lws.py), and its config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.devstack.cluster import lws

CRD = {
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {"versions": [{"name": "v1"}], "conversion": {"strategy": "Webhook", "webhook": {"clientConfig": {}}}},
}
RENDERED: list[dict[str, Any]] = [
    CRD,
    {"kind": "Secret", "metadata": {"name": "lws-webhook-server-cert"}},
    {"kind": "Deployment", "metadata": {"name": "lws-controller-manager"}},
    {"kind": "ClusterRole", "metadata": {"name": "lws-manager-role"}},
    {"kind": "MutatingWebhookConfiguration", "metadata": {"name": "lws-mutating-webhook-configuration"}},
    {"kind": "ValidatingWebhookConfiguration", "metadata": {"name": "lws-validating-webhook-configuration"}},
    {
        "kind": "Service",
        "metadata": {"name": "lws-webhook-service"},
        "spec": {"ports": [{"port": 443, "targetPort": 9443}], "selector": {"control-plane": "controller-manager"}},
    },
    {"kind": "Service", "metadata": {"name": "lws-controller-manager-metrics-service"}, "spec": {}},
]


def test_the_crd_loses_its_conversion_webhook_and_nothing_runs_in_a_pod() -> None:
    selected = lws.CONTROLLER.select(RENDERED)
    assert [(d["kind"], d["metadata"]["name"]) for d in selected] == [
        ("Namespace", "lws-system"),
        ("CustomResourceDefinition", "leaderworkersets.leaderworkerset.x-k8s.io"),
        ("Secret", "lws-webhook-server-cert"),
        ("MutatingWebhookConfiguration", "lws-mutating-webhook-configuration"),
        ("ValidatingWebhookConfiguration", "lws-validating-webhook-configuration"),
        ("Service", "lws-webhook-service"),
    ]
    assert selected[1]["spec"] == {"versions": [{"name": "v1"}], "conversion": {"strategy": "None"}}
    assert CRD["spec"]["conversion"]["strategy"] == "Webhook"  # the chart's object is not changed in place
    assert selected[-1]["spec"] == {"ports": [{"port": 443, "targetPort": 9443}]}  # served from the host


def test_the_host_process_binds_loopback_without_leader_election_and_rotates_its_own_certificate(
    tmp_path: Path,
) -> None:
    config = lws.CONTROLLER.configuration(40001, 40002, tmp_path)
    assert config["apiVersion"] == "config.lws.x-k8s.io/v1alpha1"
    assert config["webhook"] == {"host": "127.0.0.1", "port": 40001, "certDir": str(tmp_path)}
    assert config["health"] == {"healthProbeBindAddress": "127.0.0.1:40002"}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {
        "enable": True, "webhookServiceName": "lws-webhook-service", "webhookSecretName": "lws-webhook-server-cert",
    }  # fmt: skip
    assert "namespace" not in config  # Kueue's extra fields are Kueue's only
    assert lws.CONTROLLER.config_file.parent == lws.CONTROLLER.cert_dir.parent
