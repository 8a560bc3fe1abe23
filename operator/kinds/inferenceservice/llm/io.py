"""The LLM runtime's edge and hooks (LlmFeature): the TrainingJobs spec.adapters names, and each ready replica's
adapter states, read from its front (GET /v2/adapters on the pod's IP, as Prometheus scrapes it and the TrainingJob
controller reads progress). Reading changes nothing: an operator killed mid-pass reads again next pass."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from loom.workloads.llm.adapters import ADAPTERS_PATH

from ....core import client as kube
from ....core.kit import Event, Manifest
from ....core.model import API_VERSION
from ....defaults import EndpointDefaults, training_job_manifest
from ..api import InferenceServiceSpec, InferenceServiceStatus
from ..feature import Feature, Observed, Plan, ServicePass
from ..render import SERVER_PORT
from . import disaggregation, multinode
from .adapters import ResolvedAdapters, adapter_status, name_problem, resolve_adapters, settled

log = logging.getLogger("loom.operator.inferenceservice.adapters")
TIMEOUT = httpx.Timeout(2.0)
# While an adapter loads somewhere, the next look at the replicas' adapter states (status follows them).
ADAPTER_POLL_SECONDS = 2.0


async def observe_adapters(
    spec: InferenceServiceSpec, namespace: str, defaults: EndpointDefaults
) -> ResolvedAdapters | None:
    if spec.adapters is None:
        return None
    jobs: dict[str, dict[str, Any] | None] = {}
    for adapter in spec.adapters:
        ref = adapter.from_training_job
        if ref is not None and ref.name not in jobs:
            job = await kube.get(API_VERSION, "TrainingJob", namespace, ref.name)
            jobs[ref.name] = training_job_manifest(job, defaults) if job is not None else None
    return resolve_adapters(spec, jobs, spec.model.tracking_uri or defaults.mlflow_tracking_uri)


def _ready_ip(pod: Manifest) -> str | None:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return str(status["podIP"]) if ready else None


async def read_reports(pods: list[Manifest], port: int = SERVER_PORT) -> dict[str, dict[str, Any] | str]:
    """Pod name -> its front's adapter report (or why it could not be read), for every ready replica."""
    targets = {p["metadata"]["name"]: ip for p in pods if (ip := _ready_ip(p)) is not None}
    if not targets:
        return {}

    async def one(client: httpx.AsyncClient, ip: str) -> dict[str, Any] | str:
        try:
            response = await client.get(f"http://{ip}:{port}{ADAPTERS_PATH}")
        except httpx.HTTPError as exc:
            return f"its adapter states could not be read: {type(exc).__name__}"
        if response.status_code != 200:
            return f"its adapter states could not be read: HTTP {response.status_code}"
        try:
            doc = response.json()
        except ValueError:
            return "its adapter states could not be read: not JSON"
        return doc if isinstance(doc, dict) else "its adapter states could not be read: not an object"

    # Pod IPs are the cluster's own: never through a proxy the environment may name for the outside.
    async with httpx.AsyncClient(timeout=TIMEOUT, trust_env=False) as client:
        answers = await asyncio.gather(*(one(client, ip) for ip in targets.values()))
    return dict(zip(targets, answers, strict=True))


async def read_pools(namespace: str, track_deployment: str) -> Manifest | None:
    """A track run as prefill and decode pools, in a Deployment's words (disaggregation.track_view); None: neither
    pool exists (Deployments are in the watch cache: no request for an absent one)."""
    found = {
        role: await kube.get("apps/v1", "Deployment", namespace, disaggregation.pool_name(track_deployment, role))
        for role in disaggregation.ROLES
    }
    return disaggregation.track_view(track_deployment, found)


async def apply_pools(deployment: Manifest, spec: InferenceServiceSpec) -> Manifest:
    """The track's rendered Deployment applied as its two pools; the view of what was applied."""
    applied: dict[disaggregation.Role, Manifest | None] = {}
    for role, pool in zip(disaggregation.ROLES, disaggregation.pools(deployment, spec), strict=True):
        applied[role] = await kube.apply(pool)
    view = disaggregation.track_view(deployment["metadata"]["name"], applied)
    assert view is not None
    return view


class LlmFeature(Feature):
    """spec.adapters: LoRA adapters resolved each pass and loaded by the replicas themselves (their states read
    from each ready replica's front). spec.vllm is the runtime's render (vllm.py), called by the core's."""

    def check(self, body: Manifest, spec: InferenceServiceSpec) -> str | None:
        return name_problem(body, spec) or multinode.check(spec, body["metadata"]["name"])

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        if not p.ctx.valid:
            return
        seen.adapters = await observe_adapters(p.spec, p.ctx.namespace, p.defaults)
        if seen.adapters is not None:
            seen.adapter_reports = await read_reports(seen.pods)

    async def after_apply(self, p: ServicePass, seen: Observed, plan: Plan) -> None:
        # Replicas load adapters by themselves; look again soon while any is on its way (status follows).
        if seen.adapters is not None and not settled(adapter_status(seen.adapters, seen.adapter_reports)):
            p.later(ADAPTER_POLL_SECONDS)

    def status(
        self, p: ServicePass, seen: Observed, plan: Plan, status: InferenceServiceStatus,
        previous: InferenceServiceStatus | None,
    ) -> list[Event]:
        if seen.adapters is not None:
            status.adapters = adapter_status(seen.adapters, seen.adapter_reports)
        # The pools of the track that serves (a canary never runs as pools: admission refuses one).
        status.disaggregation = disaggregation.pool_status(seen.stable)
        if status.disaggregation is not None:
            status.conditions = disaggregation.with_pools_in_ready(
                status.conditions, status.disaggregation, seen.pods
            )
            status.phase = disaggregation.phase_with_pools(status.phase, status.conditions)
        return []
