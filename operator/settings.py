"""Operator settings, read once from the environment (the Helm chart sets them): the only place that reads
`LOOM_*` variables for the operator. Every field `x` is set by `LOOM_X` (upper case); `LOOM_NAMESPACES` is a
comma-separated list.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from loom.workloads.activator.config import DEFAULT_MAX_HELD, DEFAULT_TIMEOUT_SECONDS, HoldSeconds, MaxHeld

PREFIX = "loom.dev"
FIELD_MANAGER = "loom-operator"
FINALIZER = f"{PREFIX}/finalizer"
ENV_PREFIX = "LOOM_"

# A fully qualified image reference: a registry host first (it has a dot or a port, or is localhost: the rule
# container runtimes use to tell a host from a path), then the path, then a tag, a sha256 digest or both.
# The chart's values.schema.json checks its registry and repository values with the same host and path parts.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:(?:localhost|{_LABEL}(?:\.{_LABEL})+)(?::[0-9]+)?|{_LABEL}:[0-9]+)"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG, _DIGEST = r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", r"@sha256:[a-f0-9]{64}"
IMAGE_REFERENCE = rf"^{_HOST}(?:/{_PATH})+(?:{_TAG}(?:{_DIGEST})?|{_DIGEST})$"
_IMAGE_HINT = (
    "each LOOM_*_IMAGE must name its registry host and a tag or digest, e.g. registry.example.com/loom/trainer:0.1.0"
    " (Loom publishes no image: `make images push` pushes them and prints the chart's image.registry to set)"
)


class OperatorSettings(BaseModel):
    namespaces: list[str] = Field(default_factory=list, description="Namespaces to watch; empty = cluster-wide.")
    # Liveness (/healthz) and Prometheus metrics endpoints. Loopback by default: `loom operator` run on a
    # machine must neither expose unauthenticated endpoints to the network nor take a port from every address
    # (on the local stack pods share the host network, and a wildcard bind of 8080 would take the model
    # servers' port). In a pod the chart sets 0.0.0.0, so the kubelet's probe and Prometheus reach the pod IP.
    health_host: str = "127.0.0.1"
    health_port: int = Field(8080, ge=1, le=65535)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(8081, ge=1, le=65535)
    log_level: str = "INFO"
    # "json": one JSON object per line (python-json-logger, Kopf's field names) with an `object` field (apiVersion,
    # kind, namespace, name) on every line about an object; "text" prefixes such lines with [Kind namespace/name].
    log_format: Literal["text", "json"] = "text"
    # The images of the pods the operator creates. No defaults: Loom publishes no image, and an unqualified name
    # (`loom/trainer`) would resolve to the default public registry's `loom` namespace, which Loom does not own.
    # Each must name its registry host (the chart sets them from image.registry; `make images push` prints them).
    trainer_image: str = Field(pattern=IMAGE_REFERENCE)
    server_image: str = Field(pattern=IMAGE_REFERENCE)
    router_image: str = Field(pattern=IMAGE_REFERENCE)
    # Feast pods (apply/materialize Jobs, the feature server): the [features] extra.
    features_image: str = Field(pattern=IMAGE_REFERENCE)
    # InferenceService runtime vllm (images/vllm.Dockerfile): the vLLM engine and Loom's OpenAI front in one image,
    # for the fetch step and the server container alike; spec.image still overrides it per service.
    vllm_image: str = Field(pattern=IMAGE_REFERENCE)
    # Admission webhook (operator/admission): served with TLS only when a certificate folder is set (the chart
    # mounts its Secret there); a host-process operator serves none. In a pod the chart sets the host 0.0.0.0.
    webhook_cert_dir: str | None = None
    webhook_host: str = "127.0.0.1"
    webhook_port: int = Field(9443, ge=1, le=65535)
    # References to objects that do not exist: admitted with a warning (GitOps applies in any order) or rejected.
    webhook_missing_references: Literal["Warn", "Reject"] = "Warn"
    # Watches are re-established this often so a silently dropped connection cannot stall reconciliation.
    watch_server_timeout_s: int = 300
    watch_client_timeout_s: int = 330
    # Periodic re-reconcile of every object: the safety net that makes status converge after missed events.
    resync_interval_s: float = Field(30.0, gt=0)
    # One reconcile pass may take this long; then it is abandoned (a hung API call must not wedge an object).
    reconcile_timeout_s: float = Field(120.0, gt=0)
    # TrainingJob: how often a job that is not idle is reconciled (progress, deadlines, grace periods, TTLs); a
    # steady running one (kinds/trainingjob/pacing.py) is instead asked for progress this often, and reconciled
    # when the answer changes, when an event comes, and at least every resync safety net (pacing.QUIET_S).
    training_poll_s: float = Field(5.0, gt=0)
    # TrainingJob: how long a worker's node may be NotReady before the worker counts as lost.
    node_lost_grace_s: float = Field(60.0, ge=0)
    # Autoscaling (engine builtin): the Prometheus asked for the metrics (unset: autoscaled services hold their
    # replicas with MetricsAvailable=False), how often each autoscaled service is decided on, and the rate()
    # window of requests-per-second (at least two scrape intervals of that Prometheus).
    prometheus_url: str | None = Field(None, pattern=r"^https?://")
    autoscale_interval_s: float = Field(5.0, gt=0, le=60)
    autoscale_rate_window_s: int = Field(30, ge=2, le=3600)
    # Scale to zero (minReplicas 0, engine builtin): the activator holds a request at most this long for a replica
    # to become Ready, then answers 503 with Retry-After; it holds at most this many requests at once.
    activator_timeout_s: HoldSeconds = DEFAULT_TIMEOUT_SECONDS
    activator_max_held: MaxHeld = DEFAULT_MAX_HELD
    # Cluster-wide endpoint defaults (the chart's `defaults.*` values), filled into the fields an object leaves
    # unset (operator/defaults.py; status.endpointDefaults shows what was used): the S3 endpoint and the
    # name of a credentials Secret expected in each object's namespace (referenced by pods, never read by the
    # operator) for checkpoints, model sources, feature sources and registries; the MLflow tracking server of
    # TrainingJob tracking and models:/ sources. Unset: no default (no S3 endpoint means AWS; a missing tracking
    # URI is reported as Ready=False, EndpointNotConfigured).
    default_s3_endpoint: str | None = Field(None, pattern=r"^https?://", max_length=1024)
    default_s3_secret_name: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    default_mlflow_tracking_uri: str | None = Field(None, pattern=r"^https?://", max_length=1024)
    # The node cache of S3 and MLflow models (loom.workloads.server.node_cache): a folder on every node, mounted
    # (hostPath) into each InferenceService pod's fetch step, so that a second replica on a node that already holds
    # the same content links it from there instead of downloading it. It must exist, writable by the pods' user
    # (uid 1000); a fetch step that cannot write it downloads as without it. Least recently used entries are removed
    # past the limit. Unset: every pod downloads its own copy (and no pod mounts a hostPath, which Pod Security's
    # "restricted" level forbids).
    model_node_cache_dir: str | None = Field(None, pattern=r"^/[^,]*$", max_length=1024)
    model_node_cache_limit_bytes: int = Field(50 * 2**30, gt=0)
    # High availability (Kopf peering). With a name, replicas sharing it elect one active replica through the
    # cluster-scoped ClusterKopfPeering of that name (the chart creates it); the others stand by, paused. Unset:
    # standalone (one replica, no peering object needed). The priority decides who is active: unset, the oldest
    # replica (priority = minus its start time in ms), so a replacement never preempts the one that works. A
    # replica is presumed dead `peering_lifetime_s` after its last keep-alive: the bound of a takeover.
    peering_name: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    peering_priority: int | None = None
    peering_lifetime_s: int = Field(30, ge=5, le=3600)
    # This replica's identity among its peers (the chart sets the pod's name); unset: user@host/start-time.
    pod_name: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for field in cls.model_fields:
            key = ENV_PREFIX + field.upper()
            if key not in env:
                continue
            if field == "namespaces":
                values[field] = [ns.strip() for ns in env[key].split(",") if ns.strip()]
            else:
                values[field] = env[key]  # pydantic converts and checks ("5" -> 5.0, "x" -> an error)
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            problems, images = [], False
            for e in error.errors():
                field = str(e["loc"][0])
                key = ENV_PREFIX + field.upper()
                if field.endswith("_image"):  # say what to set, not the pattern
                    images = True
                    found = f"{key}={env[key]!r} is no qualified image" if key in env else f"{key} is not set"
                    problems.append(found)
                else:
                    problems.append(f"{key}={env.get(key)!r}: {e['msg']}")
            if images:
                problems.append(_IMAGE_HINT)
            raise ValueError(f"invalid operator settings: {'; '.join(problems)}") from None
