"""Operator start-up: Kopf settings (own prefix, finalizer, watch timeouts), liveness and metrics endpoints."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from typing import Any, cast

import kopf
import uvloop

from . import controllers
from .admission import handlers as admission_handlers
from .admission.server import webhook_server
from .api import KINDS
from .core import client as kube
from .core import leadership, observability, runtime
from .core.kit import MANAGED_BY
from .core.namespace_watch import notice_namespaces_listed_by_the_watch
from .settings import FINALIZER, PREFIX, OperatorSettings

log = logging.getLogger("loom.operator")


class NoDiffBase(kopf.DiffBaseStorage):
    """Kopf's record of the last handled spec, kept nowhere: only Kopf's create/update handlers read it, and Loom
    registers none (core/runner.py `own_kind_handlers` says why; a unit test holds it). Kopf builds the record for
    every event of every resource it watches all the same, a deep copy of the whole body (a pod's status included,
    then dropped): a tenth of the operator's CPU in a burst of 200 TrainingJobs (bench/bench_kubeflow_p1.py)."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


# The resources Loom watches only for its own children: each handler on them wants objects Loom made, and every
# one of those carries `app.kubernetes.io/managed-by: loom-operator` (core/kit.py `labels`, on pod templates too).
# Filtered by the API server, a cluster-wide operator no longer receives (and Kopf no longer parses) the events of
# every other pod, Service, ConfigMap, Deployment and Job of the cluster. Nodes, Loom's kinds and Kueue's
# Workloads are not Loom's children and stay unfiltered.
CHILD_RESOURCES = (("", "v1", "pods"), ("", "v1", "services"), ("", "v1", "configmaps"),
                   ("apps", "v1", "deployments"), ("batch", "v1", "jobs"))  # fmt: skip
CHILD_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"


def configure(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    """Apply Loom's conventions to Kopf's settings (pure: unit-tested)."""
    settings.persistence.finalizer = FINALIZER
    # Annotations, not status: the CRD status schema is structural, so kopf's status fields would be pruned.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = ours.watch_server_timeout_s
    settings.watching.client_timeout = ours.watch_client_timeout_s
    settings.watching.connect_timeout = 10
    for resource in CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = CHILD_SELECTOR
    settings.posting.level = logging.INFO
    # One bad object must never stall the others: errors back off per object, up to a few minutes.
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60, 120, 300]
    settings.networking.error_backoffs = [1, 2, 5, 10, 30]
    settings.execution.max_workers = 20
    # HA (peering_name set): one cluster-scoped ClusterKopfPeering per release, also for a namespaced operator
    # (Kopf would otherwise want a KopfPeering in every watched namespace, even ones matched by a pattern later).
    settings.peering.clusterwide = True
    settings.peering.lifetime = ours.peering_lifetime_s
    settings.peering.stealth = True  # no log line per keep-alive


def endpoint(host: str, port: int, path: str) -> str:
    """http URL of one of the operator's own endpoints (an IPv6 host goes in brackets)."""
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


class PortInUse(RuntimeError):
    """One of the operator's own ports is taken (most often: another operator already runs on this machine)."""


def listening_ports(ours: OperatorSettings) -> list[tuple[str, str, int]]:
    """(what, host, port) of each port the operator listens on, named by the setting that moves it."""
    ports = [
        ("liveness (LOOM_HEALTH_PORT)", ours.health_host, ours.health_port),
        ("metrics (LOOM_METRICS_PORT)", ours.metrics_host, ours.metrics_port),
    ]
    if ours.webhook_cert_dir:
        ports.append(("admission webhook (LOOM_WEBHOOK_PORT)", ours.webhook_host, ours.webhook_port))
    return ports


def check_ports_free(ports: list[tuple[str, str, int]]) -> None:
    """Refuse to start, with a sentence, when a port is taken: Kopf would otherwise fail later, inside its startup,
    with a bare "Address already in use" traceback that names no port."""
    for what, host, port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves bind
            try:
                probe.bind((host, port))
            except OSError as error:
                raise PortInUse(
                    f"cannot listen on {host}:{port} for {what}: {error.strerror}. Is another Loom "
                    "operator running on this machine? Stop it, or give this one other ports."
                ) from None


def run(settings: OperatorSettings | None = None) -> None:
    """Run the operator against the current kubeconfig (or in-cluster config) until interrupted."""
    ours = settings or OperatorSettings.from_env()
    check_ports_free(listening_ports(ours))
    controllers.register(ours)
    # Admission (operator/admission): validating handlers only where a certificate lets the webhook be served.
    server = webhook_server(ours)
    if server is not None:
        admission_handlers.register(ours)
    observability.register_phase_indices((kind.kind, kind.plural) for kind in KINDS)
    observability.count_watch_restarts()
    notice_namespaces_listed_by_the_watch()
    identity, priority = leadership.identity_of(ours), leadership.priority_of(ours)
    leadership.LEADERSHIP.configure(ours.peering_name, identity, priority, lifetime_s=ours.peering_lifetime_s)
    # Last before the loop: what start-up made is frozen out of every garbage collection (core/runtime.py says why).
    runtime.tune_garbage_collector()
    background: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    @kopf.on.startup()
    async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, ours)
        await kube.warm_up()  # the first burst's passes find their connections open (client.WARM_CONNECTIONS)
        settings.admission.server = server  # the chart owns the ValidatingWebhookConfiguration (managed: None)
        observability.serve_metrics(ours.metrics_port, ours.metrics_host)  # /metrics only: 404 elsewhere
        background.add(asyncio.get_running_loop().create_task(runtime.measure_loop_lag()))
        log.info(
            "loom operator started (metrics on %s, liveness on %s)",
            endpoint(ours.metrics_host, ours.metrics_port, "/metrics"),
            endpoint(ours.health_host, ours.health_port, "/healthz"),
        )

    @kopf.on.cleanup()
    async def _cleanup(**_: Any) -> None:
        await kube.close()

    # uvloop's event loop, the one `kopf run` uses when it is installed: the operator's CPU per TrainingJob in P1
    # 0.026-0.033 -> 0.024-0.025 s (bench/bench_kubeflow_p1.py, 2026-11-28); the passes, watches and polls are all I/O.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        loop.run(
            kopf.operator(
                clusterwide=not ours.namespaces,
                namespaces=ours.namespaces,
                liveness_endpoint=endpoint(ours.health_host, ours.health_port, "/healthz"),
                # Peering (HA) when a peering name is set: the oldest live replica reconciles (core/leadership.py).
                standalone=ours.peering_name is None,
                peering_name=ours.peering_name,
                priority=priority,
                identity=cast(Any, identity),  # Kopf's Identity is a NewType of str it does not export
            )
        )
