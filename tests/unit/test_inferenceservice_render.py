"""Rendering of an InferenceService's children: ConfigMap (the server contract), Deployment, Service."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import (
    CONFIG_HASH_ANNOTATION,
    InvalidSpec,
    Track,
    render_deployment,
    render_service,
    rollout_strategy,
    selector_string,
    service_url,
)
from loom.operator.kinds.inferenceservice.source.model import MODEL_ANNOTATION, ModelRef, resolve_model
from loom.workloads.server.config import ServerConfig

IMAGE = "loom/server:test"


def owner(spec: dict[str, Any], name: str = "gpt") -> dict[str, Any]:
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ml", "uid": "uid-1", "generation": 3},
        "spec": spec,
    }


def render(
    spec_wire: dict[str, Any], track: Track = "stable", replicas: int = 2
) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = InferenceServiceSpec.model_validate(spec_wire)
    ref = resolve_model(spec.model, spec.handler)
    config_map: dict[str, Any]
    deployment: dict[str, Any]
    config_map, deployment = render_deployment(owner(spec_wire), spec, track, ref, replicas, IMAGE)
    return config_map, deployment


BASE = {
    "model": {
        "uri": "s3://models/gpt/v1",
        "endpoint": "http://s3.storage:9000",
        "secretRef": {"name": "s3-creds"},
    },
    "handler": "chargpt",
}


def containers(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return pod["initContainers"][0], pod["containers"][0]


def test_config_map_holds_a_valid_server_config_that_the_server_reads_back() -> None:
    config_map, deployment = render({**BASE, "batching": {"maxBatchSize": 16, "maxLatencyMs": 7}})
    config = ServerConfig.model_validate(json.loads(config_map["data"]["server.json"]))
    assert config.model_name == "gpt"
    assert config.storage_uri == "s3://models/gpt/v1"
    assert config.storage_kind == "s3"
    assert config.model_version == "v1"
    assert config.handler == "chargpt"
    assert config.model_dir == "/models"
    assert (config.batching.max_batch_size, config.batching.max_latency_ms) == (16, 7)
    assert config.device == "cpu"
    assert config_map["metadata"]["name"] == "gpt-config"
    # The pod mounts exactly that ConfigMap, and the template changes whenever the config does.
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "gpt-config"
    _, other = render({**BASE, "batching": {"maxBatchSize": 32}})

    def hash_of(deployment: dict[str, Any]) -> str:
        return str(deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])

    assert hash_of(deployment) != hash_of(other)
    assert hash_of(deployment) == hash_of(render({**BASE, "batching": {"maxBatchSize": 16, "maxLatencyMs": 7}})[1])


def test_children_carry_owner_reference_and_standard_labels() -> None:
    config_map, deployment = render(BASE)
    service = render_service(owner(BASE))
    for child in (config_map, deployment, service):
        ref = child["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceService", "gpt", "uid-1", True)
        assert child["metadata"]["namespace"] == "ml"
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "loom-operator"
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "gpt"


def test_init_container_fetches_into_a_size_limited_cache_and_server_serves_from_it() -> None:
    _, deployment = render({**BASE, "cacheSizeLimit": "3Gi"})
    fetch, server = containers(deployment)
    assert fetch["command"] == ["python", "-m", "loom.workloads.server.fetch", "--config", "/etc/loom/server.json"]
    assert server["command"][:5] == ["python", "-m", "loom.workloads.server", "--config", "/etc/loom/server.json"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "3Gi"}}
    for container in (fetch, server):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["model-cache"] == "/models"
        assert mounts["config"] == "/etc/loom"


def test_a_removed_replica_drains_within_its_grace_period() -> None:
    """preStop sleeps while the endpoint removal propagates; then the server drains 1 s, finishes requests for
    up to 30 s, and the grace period covers all of it plus time to exit."""
    _, deployment = render(BASE)
    _, server = containers(deployment)
    pod_spec = deployment["spec"]["template"]["spec"]
    assert server["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    flags = server["command"][5:]
    # The drain outlasts clients' idle keep-alive expiry (httpx 5 s): no idle connection is closed under a client.
    assert flags == ["--drain-seconds", "6", "--shutdown-timeout", "30"]
    assert pod_spec["terminationGracePeriodSeconds"] == 5 + 6 + 30 + 2


def test_probes_ports_and_service() -> None:
    _, deployment = render(BASE)
    _, server = containers(deployment)
    assert server["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    service = render_service(owner(BASE))
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    # The Service selects both tracks; each Deployment selects only its own.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"]["loom.dev/track"] == "stable"
    assert "loom.dev/track" not in service["spec"]["selector"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service_url(owner(BASE)) == "http://gpt.ml.svc"
    assert selector_string(owner(BASE)) == (
        "app.kubernetes.io/component=server,app.kubernetes.io/instance=gpt,app.kubernetes.io/name=inferenceservice"
    )


def test_s3_credentials_are_secret_references_never_values() -> None:
    config_map, deployment = render({**BASE, "env": [{"name": "EXTRA", "value": "1"}]})
    fetch, server = containers(deployment)
    for container in (fetch, server):
        env = {e["name"]: e for e in container["env"]}
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
            "secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
        }
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
        }
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
        assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://s3.storage:9000"
        assert env["EXTRA"]["value"] == "1"
    assert "s3-creds" not in config_map["data"]["server.json"]


def test_user_env_replaces_loom_env_of_the_same_name_once() -> None:
    _, deployment = render({**BASE, "env": [{"name": "AWS_ENDPOINT_URL_S3", "value": "http://other:9000"}]})
    _, server = containers(deployment)
    names = [e["name"] for e in server["env"]]
    assert names.count("AWS_ENDPOINT_URL_S3") == 1  # server-side apply rejects duplicate list keys
    assert {e["name"]: e for e in server["env"]}["AWS_ENDPOINT_URL_S3"]["value"] == "http://other:9000"


def test_api_keys_secret_is_mounted_as_a_file_the_config_names() -> None:
    spec = {
        **BASE,
        "auth": {"apiKeysSecretRef": {"name": "keys", "key": "api-keys"}, "rateLimit": {"requestsPerSecond": 5}},
    }
    config_map, deployment = render(spec)
    fetch, server = containers(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "keys"
    assert volumes["api-keys"]["secret"]["items"] == [{"key": "api-keys", "path": "keys"}]
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["api-keys"]["mountPath"] == "/var/run/loom/api-keys" and mounts["api-keys"]["readOnly"]
    assert "api-keys" not in {m["name"] for m in fetch["volumeMounts"]}  # the fetch step has no use for them
    config = ServerConfig.model_validate(json.loads(config_map["data"]["server.json"]))
    assert config.auth.api_keys_file == "/var/run/loom/api-keys/keys"
    assert config.auth.rate_limit is not None and config.auth.rate_limit.requests_per_second == 5


def test_restricted_security_context() -> None:
    _, deployment = render(BASE)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    for container in containers(deployment):
        ctx = container["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}


def test_gpus_go_to_the_server_only_with_a_toleration_and_cuda() -> None:
    spec = {**BASE, "gpus": 2, "resources": {"limits": {"memory": "8Gi"}}}
    config_map, deployment = render(spec)
    fetch, server = containers(deployment)
    assert server["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "2"}
    assert server["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in fetch.get("resources", {}).get("limits", {})
    tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert json.loads(config_map["data"]["server.json"])["device"] == "cuda"


def test_replicas_strategy_and_min_ready_seconds() -> None:
    _, deployment = render({**BASE, "rollout": {"minReadySeconds": 9}}, replicas=4)
    assert deployment["spec"]["replicas"] == 4
    assert deployment["spec"]["minReadySeconds"] == 9
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
    }


def test_deployment_records_its_model_for_later_reconciles() -> None:
    _, deployment = render(BASE)
    ref = ModelRef.from_annotation(deployment["metadata"]["annotations"][MODEL_ANNOTATION])
    assert ref is not None and ref.storage_uri == "s3://models/gpt/v1" and ref.version == "v1"


def test_canary_track_has_its_own_names_and_selector() -> None:
    config_map, deployment = render(BASE, track="canary", replicas=1)
    assert deployment["metadata"]["name"] == "gpt-canary"
    assert config_map["metadata"]["name"] == "gpt-canary-config"
    assert deployment["spec"]["selector"]["matchLabels"]["loom.dev/track"] == "canary"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "gpt-canary-config"


def spec_with(rollout: dict[str, Any], gpus: int = 0) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({**BASE, "gpus": gpus, "rollout": rollout})


@pytest.mark.parametrize(
    ("gpus", "rollout", "expected"),
    [
        # GPUs: no spare GPU assumed, so never surge; replace one replica at a time.
        (1, {}, {"maxSurge": 0, "maxUnavailable": 1}),
        # CPU: keep every replica serving and add new ones first.
        (0, {}, {"maxSurge": "25%", "maxUnavailable": 0}),
        # A user who knows there is spare GPU capacity may surge; unavailability stays the GPU default.
        (1, {"maxSurge": 1}, {"maxSurge": 1, "maxUnavailable": 1}),
        # Zeroing one knob makes the other at least 1, so the rollout can progress.
        (0, {"maxSurge": 0}, {"maxSurge": 0, "maxUnavailable": 1}),
        (1, {"maxUnavailable": 0}, {"maxSurge": 1, "maxUnavailable": 0}),
        (0, {"maxUnavailable": "50%"}, {"maxSurge": "25%", "maxUnavailable": "50%"}),
        (0, {"maxSurge": 2, "maxUnavailable": 1}, {"maxSurge": 2, "maxUnavailable": 1}),
    ],
)
def test_rollout_defaults_cannot_deadlock(gpus: int, rollout: dict[str, Any], expected: dict[str, Any]) -> None:
    assert rollout_strategy(spec_with(rollout, gpus)) == expected


@pytest.mark.parametrize("values", [(0, 0), ("0%", 0), (0, "0%")])
def test_both_knobs_zero_is_an_invalid_spec(values: tuple[Any, Any]) -> None:
    with pytest.raises(InvalidSpec, match="cannot both be 0"):
        rollout_strategy(spec_with({"maxSurge": values[0], "maxUnavailable": values[1]}))
