"""InferenceService -> ConfigMap(s), Deployment(s), Service (pure: no I/O, unit-tested).

Layout of the children of InferenceService `<name>`:

    Service     <name>                 ClusterIP, port 80 -> the server's http port, selects every server pod
    Deployment  <name>                 the stable track (the only one outside a canary)
    ConfigMap   <name>-config          its ServerConfig
    Deployment  <name>-canary          the new model while rollout.canaryPercent holds it back
    ConfigMap   <name>-canary-config

Both tracks' pods match the Service, so the traffic share of the canary is its share of ready replicas
(see inferenceservice_rollout.split_replicas). Each pod fetches its model into an emptyDir cache in an init
container, then the server loads it (a model image, model.uri oci://, is mounted as an image volume instead: no init
container, the node's container runtime pulls it once); readiness (/v2/health/ready) turns true only once the model
is loaded, so the Service never sends a request to a replica that cannot answer it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from loom.workloads.llm.adapters import AdapterList
from loom.workloads.server.config import (
    AuthConfig,
    BatchingConfig,
    EnrichmentConfig,
    RateLimitConfig,
    ServerConfig,
)

from ...core.kit import (
    Manifest,
    child_metadata,
    cpu_threads_env,
    labels,
    match_labels,
    merge_env,
    restricted_security_context,
    s3_env,
    selector,
)
from ...core.model import InvalidSpec as InvalidSpec  # re-exported
from .api import InferenceServiceSpec
from .llm.vllm import apply_vllm_runtime
from .source.model import MODEL_ANNOTATION, ModelRef

Track = Literal["stable", "canary"]

KIND_LABEL = "inferenceservice"
COMPONENT = "server"
TRACK_LABEL = "loom.dev/track"
CONFIG_HASH_ANNOTATION = "loom.dev/config-hash"

SERVER_PORT = 8080
SERVICE_PORT = 80
CONFIG_DIR = "/etc/loom"
CONFIG_FILE = "server.json"
MODEL_DIR = "/models"
# Where a model image (model.uri: oci://...) is mounted, read-only, as an image volume.
MODEL_IMAGE_DIR = "/model"
API_KEYS_DIR = "/var/run/loom/api-keys"
API_KEYS_FILE = "keys"
GPU_RESOURCE = "nvidia.com/gpu"
# Prometheus' pod discovery convention: the server's own metrics (queue depth, in-flight, requests, NVML GPU
# series) are on its http port; the autoscaler reads them through Prometheus.
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(SERVER_PORT),
    "prometheus.io/path": "/metrics",
}
# Seconds a terminating replica keeps serving while endpoint removal propagates to every proxy.
DRAIN_SECONDS = 5
# After SIGTERM the server still answers (not ready, closing keep-alive) this long, then stops accepting and closes
# idle connections. Longer than clients' idle keep-alive expiry (httpx: 5 s), so by then every kept-alive connection
# was either used once more (answered with Connection: close) or dropped by its client: closing an idle connection
# first races with a request the client sends on it (lost: "server disconnected without sending a response"; the
# chaos serving load found 7 in 3100 requests through a rollout, a promotion and a scale-down with 1 s).
SERVER_DRAIN_SECONDS = 6
# The longest request (streams included) a replica being removed still finishes; the spec has no request timeout.
REQUEST_GRACE_SECONDS = 30
# The preStop sleep, the server's drain window, the longest request, and 2 s to stop the data plane and exit.
TERMINATION_GRACE_SECONDS = DRAIN_SECONDS + SERVER_DRAIN_SECONDS + REQUEST_GRACE_SECONDS + 2


def service_name(name: str) -> str:
    return name


def deployment_name(name: str, track: Track) -> str:
    return name if track == "stable" else f"{name}-canary"


def config_map_name(name: str, track: Track) -> str:
    return f"{deployment_name(name, track)}-config"


def server_selector(owner: Manifest) -> dict[str, str]:
    """Labels of every server pod of this InferenceService, both tracks (the Service's selector)."""
    return match_labels(owner, COMPONENT)


def selector_string(owner: Manifest) -> str:
    """The scale subresource's label selector, in `kubectl get -l` form."""
    return selector(server_selector(owner))


def service_url(owner: Manifest) -> str:
    meta = owner["metadata"]
    return f"http://{service_name(meta['name'])}.{meta['namespace']}.svc"


# ------------------------------------------------------------------------------------------- rollout knobs


def _is_zero(value: int | str) -> bool:
    return str(value).strip().rstrip("%").strip() in ("0", "")


def rollout_strategy(spec: InferenceServiceSpec) -> dict[str, int | str]:
    """maxSurge/maxUnavailable with defaults that cannot deadlock.

    With GPUs no spare GPU is assumed: a surge pod would wait for a GPU that only the pod it replaces holds,
    so the default is to replace one replica at a time (maxSurge 0, maxUnavailable 1). On CPU the default keeps
    every replica serving (maxSurge 25%, maxUnavailable 0). A value the user sets wins; when it zeroes one knob,
    the other defaults to 1 so the rollout can still move.
    """
    gpu = spec.gpus > 0
    surge: int | str | None = spec.rollout.max_surge
    unavailable: int | str | None = spec.rollout.max_unavailable
    if surge is not None and unavailable is not None:
        if _is_zero(surge) and _is_zero(unavailable):
            raise InvalidSpec("rollout.maxSurge and rollout.maxUnavailable cannot both be 0: no rollout could progress")
        return {"maxSurge": surge, "maxUnavailable": unavailable}
    if surge is None and unavailable is None:
        return {"maxSurge": 0, "maxUnavailable": 1} if gpu else {"maxSurge": "25%", "maxUnavailable": 0}
    if surge is not None:
        default_unavailable: int | str = 1 if (gpu or _is_zero(surge)) else 0
        return {"maxSurge": surge, "maxUnavailable": default_unavailable}
    assert unavailable is not None
    default_surge: int | str = (1 if _is_zero(unavailable) else 0) if gpu else "25%"
    return {"maxSurge": default_surge, "maxUnavailable": unavailable}


# ------------------------------------------------------------------------------------------- server config


def server_config(
    owner: Manifest, spec: InferenceServiceSpec, ref: ModelRef, features: EnrichmentConfig | None = None
) -> ServerConfig:
    """The contract with the server pod (loom.workloads.server.config), rendered into the ConfigMap; `features`
    is spec.features resolved against its FeatureView (enrichment/resolve.py)."""
    auth = AuthConfig()
    if spec.auth is not None:
        rate = spec.auth.rate_limit
        auth = AuthConfig(
            api_keys_file=f"{API_KEYS_DIR}/{API_KEYS_FILE}",
            rate_limit=RateLimitConfig(requests_per_second=rate.requests_per_second, burst=rate.burst)
            if rate
            else None,
        )
    return ServerConfig(
        model_name=spec.model.name or owner["metadata"]["name"],
        model_version=ref.version,
        handler=ref.handler,
        model_dir=MODEL_DIR,
        # A model image is the folder the pod mounts: the server loads it where it is, nothing is fetched.
        storage_uri=MODEL_IMAGE_DIR if ref.storage_kind == "oci" else ref.storage_uri,
        storage_kind="local" if ref.storage_kind == "oci" else ref.storage_kind,
        batching=BatchingConfig(
            max_batch_size=spec.batching.max_batch_size,
            max_latency_ms=spec.batching.max_latency_ms,
            max_queue=spec.batching.max_queue,
        ),
        auth=auth,
        port=SERVER_PORT,
        device="cuda" if spec.gpus > 0 else "cpu",
        features=features,
    )


def config_hash(config_json: str) -> str:
    return hashlib.sha256(config_json.encode()).hexdigest()[:16]


def render_config_map(owner: Manifest, track: Track, config: ServerConfig) -> Manifest:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, config_map_name(name, track), COMPONENT, extra_labels={TRACK_LABEL: track}),
        "data": {CONFIG_FILE: config.to_json()},
    }


def render_service(owner: Manifest) -> Manifest:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, service_name(name), COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": server_selector(owner),
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


# ------------------------------------------------------------------------------------------- pods


def container_env(spec: InferenceServiceSpec, ref: ModelRef) -> list[Manifest]:
    """S3/MLflow settings for the fetch step and the server (credentials by Secret reference, never by value),
    PyTorch's thread count with the default runtime (both containers share this env; vLLM places its own threads),
    then the user's variables, which replace Loom's of the same name."""
    env = s3_env(ref.secret_ref, ref.endpoint)
    if ref.tracking_uri:
        env.append({"name": "MLFLOW_TRACKING_URI", "value": ref.tracking_uri})
    if spec.runtime != "vllm":
        env += cpu_threads_env(spec.resources)
    return merge_env(env, spec.env)


def container_resources(spec: InferenceServiceSpec, *, with_gpus: bool) -> Manifest:
    wire = spec.resources.to_wire() if spec.resources else {}
    limits: dict[str, Any] = dict(wire.get("limits") or {})
    requests: dict[str, Any] = dict(wire.get("requests") or {})
    if with_gpus and spec.gpus > 0:
        # A string, as the API server stores quantities: what is applied reads back unchanged.
        limits[GPU_RESOURCE] = str(spec.gpus)
        requests[GPU_RESOURCE] = str(spec.gpus)
    if not with_gpus:
        limits.pop(GPU_RESOURCE, None)
        requests.pop(GPU_RESOURCE, None)
    out: Manifest = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _tolerations(spec: InferenceServiceSpec) -> list[Manifest]:
    tolerations = [t.to_wire() for t in spec.tolerations or []]
    if spec.gpus > 0 and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        # GPU nodes are commonly tainted so that only GPU workloads land there.
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _probe(path: str, period: int, failures: int, timeout: int = 2) -> Manifest:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


MODEL_IMAGE_VOLUME = "model-image"
NODE_CACHE_VOLUME = "model-node-cache"
# Where the fetch step sees the node's model cache (loom.workloads.server.node_cache_io reads these variables).
NODE_CACHE_DIR = "/var/cache/loom/models"
NODE_CACHE_KINDS = ("s3", "mlflow")


@dataclass(frozen=True)
class ModelNodeCache:
    """The operator's node cache settings: the node's folder and the bytes it may hold."""

    host_path: str
    limit_bytes: int


def node_cache_parts(cache: ModelNodeCache) -> tuple[Manifest, Manifest, list[Manifest]]:
    """The hostPath volume, the fetch step's mount and its variables. Only the fetch step mounts it: the server
    loads the hard links the fetch step made in the pod's own model folder."""
    volume = {"name": NODE_CACHE_VOLUME, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    mount = {"name": NODE_CACHE_VOLUME, "mountPath": NODE_CACHE_DIR}
    env = [
        {"name": "LOOM_MODEL_NODE_CACHE", "value": NODE_CACHE_DIR},
        {"name": "LOOM_MODEL_NODE_CACHE_LIMIT_BYTES", "value": str(cache.limit_bytes)},
    ]
    return volume, mount, env


def model_image_volume(ref: ModelRef) -> Manifest:
    """The model image as a Kubernetes image volume (GA since 1.36): the container runtime pulls it by digest into its
    image store, once per node, and mounts its layers read-only; a second replica on the node pulls nothing."""
    reference = ref.storage_uri.removeprefix("oci://")
    return {"name": MODEL_IMAGE_VOLUME, "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}


def pod_template(
    owner: Manifest,
    spec: InferenceServiceSpec,
    track: Track,
    ref: ModelRef,
    config_json: str,
    image: str,
    node_cache: ModelNodeCache | None = None,
) -> Manifest:
    name = owner["metadata"]["name"]
    config_path = f"{CONFIG_DIR}/{CONFIG_FILE}"
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "model-cache", "mountPath": MODEL_DIR},
    ]
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": config_map_name(name, track)}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": str(spec.cache_size_limit)}},
    ]
    server_mounts = list(mounts)
    if spec.auth is not None:
        secret = spec.auth.api_keys_secret_ref
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": secret.name,
                    "items": [{"key": secret.key, "path": API_KEYS_FILE}],
                    "defaultMode": 0o440,
                },
            }
        )
        server_mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    if ref.storage_kind == "oci":
        volumes.append(model_image_volume(ref))
        server_mounts.append({"name": MODEL_IMAGE_VOLUME, "mountPath": MODEL_IMAGE_DIR, "readOnly": True})
    env = container_env(spec, ref)
    image_name = spec.image or image
    fetch = {
        "name": "fetch-model",
        "image": image_name,
        "command": ["python", "-m", "loom.workloads.server.fetch", "--config", config_path],
        "env": env,
        "volumeMounts": mounts,
        "securityContext": restricted_security_context(),
    }
    if node_cache is not None and ref.storage_kind in NODE_CACHE_KINDS:
        cache_volume, cache_mount, cache_env = node_cache_parts(node_cache)
        volumes.append(cache_volume)
        fetch["volumeMounts"] = [*mounts, cache_mount]
        fetch["env"] = [*env, *cache_env]
    fetch_resources = container_resources(spec, with_gpus=False)
    if fetch_resources:
        fetch["resources"] = fetch_resources
    server: Manifest = {
        "name": "server",
        "image": image_name,
        "command": [
            *("python", "-m", "loom.workloads.server", "--config", config_path),
            *("--drain-seconds", str(SERVER_DRAIN_SECONDS), "--shutdown-timeout", str(REQUEST_GRACE_SECONDS)),
        ],
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": server_mounts,
        # Ready only once the model is loaded: no request reaches a replica that cannot answer it.
        "readinessProbe": _probe("/v2/health/ready", period=2, failures=2),
        "livenessProbe": _probe("/v2/health/live", period=10, failures=3, timeout=5),
        # Importing torch and starting can be slow; liveness waits until the process has come up once.
        "startupProbe": _probe("/v2/health/live", period=2, failures=150),
        # Keep serving while the endpoint removal reaches every proxy; then SIGTERM drains in-flight requests.
        "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}},
        "securityContext": restricted_security_context(),
    }
    server_resources = container_resources(spec, with_gpus=True)
    if server_resources:
        server["resources"] = server_resources
    pod_spec: Manifest = {
        # A model image needs no fetch step: the kubelet pulls it (once per node) and mounts it before the server runs.
        **({} if ref.storage_kind == "oci" else {"initContainers": [fetch]}),
        "containers": [server],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
    }
    if ref.pull_secret_name:
        pod_spec["imagePullSecrets"] = [{"name": ref.pull_secret_name}]  # the model image's registry credentials
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "metadata": {
            "labels": labels(owner, COMPONENT, {TRACK_LABEL: track}),
            # A new config (model, batching, auth...) is a new template: the Deployment rolls it out.
            "annotations": {CONFIG_HASH_ANNOTATION: config_hash(config_json), **SCRAPE_ANNOTATIONS},
        },
        "spec": pod_spec,
    }


def render_deployment(
    owner: Manifest,
    spec: InferenceServiceSpec,
    track: Track,
    ref: ModelRef,
    replicas: int,
    image: str,
    features: EnrichmentConfig | None = None,
    vllm_image: str | None = None,
    adapters: AdapterList | None = None,
    node_cache: ModelNodeCache | None = None,
) -> tuple[Manifest, Manifest]:
    """The track's (ConfigMap, Deployment); the Deployment records its model ref for later reconciles. `image` is the
    server image, `vllm_image` the image of runtime vllm (the operator's settings give both), `node_cache` the
    node cache an S3 or MLflow model is fetched through (settings model_node_cache_dir)."""
    name = owner["metadata"]["name"]
    config = server_config(owner, spec, ref, features)
    config_map = render_config_map(owner, track, config)
    config_json = config_map["data"][CONFIG_FILE]
    selector = {**server_selector(owner), TRACK_LABEL: track}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(
            owner,
            deployment_name(name, track),
            COMPONENT,
            extra_labels={TRACK_LABEL: track},
            annotations={MODEL_ANNOTATION: ref.to_annotation()},
        ),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rollout_strategy(spec)},
            "minReadySeconds": spec.rollout.min_ready_seconds,
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 600,
            "template": pod_template(owner, spec, track, ref, config_json, image, node_cache),
        },
    }
    # runtime vllm: the same Deployment with the OpenAI front over vLLM in the server container
    if spec.runtime == "vllm" and vllm_image is None and spec.image is None:
        raise ValueError("runtime vllm needs the operator's vllm image")  # a caller's bug: settings always have one
    return apply_vllm_runtime(
        spec, config_map, deployment, config, CONFIG_DIR, CONFIG_HASH_ANNOTATION, vllm_image or image, adapters
    )


def replica_pod_template(
    owner: Manifest,
    spec: InferenceServiceSpec,
    ref: ModelRef,
    image: str,
    features: EnrichmentConfig | None,
    vllm_image: str | None,
) -> Manifest:
    """One replica's pod template, as a Kueue Workload accounts it (the stable track's, without placement)."""
    _, deployment = render_deployment(owner, spec, "stable", ref, 1, image, features, vllm_image)
    template: Manifest = deployment["spec"]["template"]
    return template
