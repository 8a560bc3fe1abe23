"""The builtin autoscaler: for every autoscaled object (InferenceService, InferenceGraph router, FeatureView server;
engine builtin), every few seconds, read its metric from Prometheus, run the pure decision
(loom.operator.autoscale.decision) and write the replicas through a scale subresource, as an HPA does. What differs
per kind (where autoscaling is declared, which pods, where replicas are written) is a small adapter
(autoscale/adapters.py, each kind's in kinds/<kind>/autoscaling/io.py); one loop per kind, each with its own index.

- One loop for all autoscaled objects (a Kopf index says which), started once like the runner's resync: no
  timer, so no finalizer. A round decides every object once and the next round starts `autoscale_interval_s`
  after the previous one started; rounds never overlap, so one object is never decided twice at once.
- The decision's memory (recommendations for the stabilization windows, scale events for the rate limits) is
  kept here per object and uid, pruned when the object leaves the index. After a restart it starts from
  `ScalingState.initial`: no scale-down before a full scale-down window has been watched.
- The replicas are written with the object's resourceVersion as a precondition: a write that races another
  writer (a user's `kubectl scale`, a spec change) fails with a conflict and is decided again from a fresh read,
  so the autoscaler never scales twice on one observation.
- Engines keda and hpa: the loop applies their ScaledObject / HorizontalPodAutoscaler (rendered by
  loom.operator.autoscale.engines, owned by the InferenceService) once per engine switch or restart, deletes the
  other engines' objects, and writes no decision: they do, through the same scale subresource. Only when
  spec.replicas is unset does it write the starting point (minReplicas, at least 1) once, as an HPA reads 0 as
  "autoscaling disabled".
- The reconcile pass (kinds/inferenceservice/controller.py) follows spec.replicas through `recommend_replicas`; the
  scale write is a spec change, so Kopf triggers that pass at once.
- status.autoscaling and the MetricsAvailable condition are written here (conditional on resourceVersion too;
  a lost race is repaired on the next round); an event goes with every change of the replicas and of the
  metric's availability. Missing, stale or unreadable metrics hold the replicas (the decision never scales down
  on them) and set MetricsAvailable=False with the reason.

GitOps: spec.replicas belongs to the autoscaler while autoscaling is set; manifests kept in Git (Argo CD, Flux)
must leave it out, as with an HPA, or every sync would undo its decisions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import kopf
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from ..core import client as kube
from ..core.events import post_events
from ..core.kit import Event, Manifest, owner_of, set_condition
from ..core.leadership import LEADERSHIP
from ..core.model import API_VERSION, GROUP, VERSION, Condition
from ..core.observability import object_context
from ..core.runner import DueIndex, Key
from ..settings import OperatorSettings
from .adapters import FIELD_MANAGER, KindAdapter, Target
from .decision import Decision, MetricUnavailable, MetricValue, Observation, ScalingState, decide
from .engines import EngineError
from .prometheus import PrometheusClient
from .report import METRICS_AVAILABLE, autoscaling_status, decision_events, metrics_condition, ready_pod_names
from .spec import Autoscaling, AutoscalingStatus, metric_query, scaling_config

log = logging.getLogger("loom.operator.autoscaler")



def index_id(adapter: KindAdapter) -> str:
    return f"loom_autoscaled_{adapter.plural}"


# A decision whose write lost a race is taken again from a fresh read, at most this often per round.
ATTEMPTS = 3


def autoscaled(spec: Any, adapter: KindAdapter) -> bool:
    """Whether an object with this spec (a raw dict, as the index sees it) is autoscaled, by any engine."""
    return isinstance(spec, dict) and adapter.autoscaling(spec) is not None


@dataclass(frozen=True)
class Memory:
    """What the autoscaler remembers about one object between rounds."""

    uid: str
    state: ScalingState | None = None  # builtin engine
    engine: str = "builtin"  # the engine whose objects exist (others were deleted)
    problem: str | None = None  # an engine error already announced
    # status.autoscaling as last decided: the last scale survives a status write lost to a race.
    reported: AutoscalingStatus | None = None


class Autoscaler:
    def __init__(
        self,
        settings: OperatorSettings,
        *,
        adapter: KindAdapter,
        clock: Callable[[], float] = time.time,
        prometheus: Callable[[], PrometheusClient | None] | None = None,
    ) -> None:
        self.settings = settings
        self.adapter = adapter
        self._shared_client = prometheus
        self._clock = clock
        self._memory: dict[Key, Memory] = {}
        self._task: asyncio.Task[None] | None = None
        self._prometheus: PrometheusClient | None = None

    @property
    def remembered(self) -> frozenset[Key]:
        return frozenset(self._memory)

    def start(self, index: DueIndex | None) -> None:
        """Start the loop over `index`, or restart it if it ended (it never should: say why it did)."""
        if index is None or (self._task is not None and not self._task.done()):
            return
        if self._task is not None:
            ended = "was cancelled" if self._task.cancelled() else f"ended: {self._task.exception()!r}"
            log.error("the autoscaler loop %s; restarting it", ended)
        self._task = asyncio.get_running_loop().create_task(self._forever(index))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._prometheus is not None:
            await self._prometheus.aclose()
            self._prometheus = None

    async def _forever(self, index: DueIndex) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                due = [key for key, flags in list(index.items()) if any(flags)]
            except Exception:  # an index changing under us: take the next round
                log.exception("reading the autoscaled %ss failed", self.adapter.kind)
                due = list(self._memory)
            if await LEADERSHIP.leads():  # a replica standing by (Kopf peering) decides nothing
                await self.round(due)
            await asyncio.sleep(max(0.0, self.settings.autoscale_interval_s - (loop.time() - started)))

    async def round(self, due: list[Key]) -> None:
        """Decide every due object once (concurrently); forget objects no longer due."""
        for key in set(self._memory) - set(due):
            del self._memory[key]
        await asyncio.gather(*(self._bounded(namespace, name) for namespace, name in due))

    async def _bounded(self, namespace: str, name: str) -> None:
        try:
            with object_context(self.adapter.kind, namespace, name):  # its log lines name the object
                await asyncio.wait_for(self.step(namespace, name), timeout=self.settings.reconcile_timeout_s)
        except TimeoutError:
            log.error("autoscaling %s/%s took over %gs; abandoned", namespace, name, self.settings.reconcile_timeout_s)
        except kube.OwnerGone:  # deleted while deciding: kube.apply refused to re-create its engine object
            log.info("autoscaling %s/%s: deleted while deciding; abandoned", namespace, name)
        except Exception:
            log.exception("autoscaling %s/%s failed", namespace, name)

    async def step(self, namespace: str, name: str) -> None:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(ATTEMPTS),
            retry=retry_if_exception_type(kube.Conflict),
            after=lambda _: log.info(
                "autoscaling %s/%s: the object changed while deciding; deciding again", namespace, name
            ),
            retry_error_callback=lambda _: None,  # still racing after ATTEMPTS: the next round decides afresh
        )
        await retrying(self._decide, namespace, name)

    def _client(self) -> PrometheusClient | None:
        if self._prometheus is None and self._shared_client is not None:
            return self._shared_client()
        if self._prometheus is None and self.settings.prometheus_url:
            self._prometheus = PrometheusClient(self.settings.prometheus_url)
        return self._prometheus

    async def _observe(
        self, autoscaling: Autoscaling, namespace: str, ready: list[str], now: float
    ) -> MetricValue | MetricUnavailable:
        client = self._client()
        if client is None:
            return MetricUnavailable(
                reason="QueryFailed", message="no Prometheus configured (operator setting LOOM_PROMETHEUS_URL)"
            )
        if not ready and autoscaling.metric != "prometheus":
            return MetricUnavailable(reason="MetricMissing", message="no ready replica to measure")
        query = metric_query(
            autoscaling, namespace, ready, rate_window_seconds=self.settings.autoscale_rate_window_s
        )
        return await client.observe(
            query, now=now, max_age_seconds=autoscaling.metric_max_age_seconds, ready_pods=set(ready)
        )

    async def _decide(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        kind = self.adapter.kind
        body = await kube.get(API_VERSION, kind, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._memory.pop(key, None)
            return
        target = await self.adapter.target(body)
        if target is None:  # not autoscaled (or invalid: the reconcile pass says so, or another object speaks)
            self._memory.pop(key, None)
            return
        autoscaling = target.autoscaling
        owner = owner_of(body, kind)
        uid = str(body["metadata"]["uid"])
        memory = self._memory.get(key)
        if memory is not None and memory.uid != uid:
            memory = None
        if memory is None or memory.engine != autoscaling.engine:
            memory = await self._converge_engine(body, owner, autoscaling, memory)
            self._memory[key] = memory
        if autoscaling.engine != "builtin":
            return  # KEDA or the HPA writes the replicas
        current = target.current_replicas
        pods = await kube.list_objects("v1", "Pod", namespace, target.selector)
        ready = ready_pod_names(pods)
        now = self._clock()
        metric = await self._observe(autoscaling, namespace, ready, now)
        state = memory.state or ScalingState.initial(now, current)
        observation = Observation(
            now=now, current_replicas=current, ready_replicas=min(len(ready), current), metric=metric
        )
        decision = decide(scaling_config(autoscaling), state, observation)
        resource_version = body["metadata"]["resourceVersion"]
        if decision.changed:
            written = await self._write_replicas(namespace, target, decision.desired_replicas)
            if (target.scale_kind, target.scale_name) == (kind, name):
                resource_version = written  # the scale write changed this object
            log.info(  # e2e/autoscaling.py and bench/ read this line (its kind is in the log context)
                "autoscaling %s/%s: %s %d -> %d: %s",
                namespace,
                name,
                decision.reason,
                decision.current_replicas,
                decision.desired_replicas,
                decision.message,
            )
        reported = await self._report(body, autoscaling, decision, resource_version, memory.reported)
        self._memory[key] = Memory(uid, decision.state, reported=reported)

    async def _write_replicas(self, namespace: str, target: Target, replicas: int) -> str:
        """Write `replicas` through the target's scale subresource (resourceVersion as a precondition: a race is a
        Conflict, decided again); the resourceVersion after the write."""
        scale = await kube.merge_patch(
            target.scale_api_version,
            target.scale_kind,
            namespace,
            target.scale_name,
            {"metadata": {"resourceVersion": target.scale_resource_version}, "spec": {"replicas": replicas}},
            subresource="scale",
            field_manager=FIELD_MANAGER,
        )
        return str(scale["metadata"]["resourceVersion"])

    async def _converge_engine(
        self, body: Manifest, owner: Manifest, autoscaling: Autoscaling, memory: Memory | None
    ) -> Memory:
        """Apply engine keda's or hpa's object, delete the other engines' (once per engine switch and restart)."""
        meta = body["metadata"]
        uid = str(meta["uid"])
        engines = self.adapter.engines
        if engines is None:
            if autoscaling.engine == "builtin":
                return Memory(uid)  # no engine objects exist for this kind
            problem = f"engine {autoscaling.engine} is for InferenceServices only; {self.adapter.kind} uses builtin"
            if memory is None or memory.problem != problem:
                post_events(body, [Event("Warning", "AutoscalingInvalid", problem)])
            return Memory(uid, engine="invalid", problem=problem)
        try:
            wanted, stale = engines.engine_object(owner, autoscaling, self.settings)
        except (EngineError, ValueError) as exc:
            problem = str(exc)
            if memory is None or memory.problem != problem:
                post_events(body, [Event("Warning", "AutoscalingInvalid", problem)])
                log.warning("autoscaling %s/%s: %s", meta["namespace"], meta["name"], problem)
            return Memory(uid, engine="invalid", problem=problem)
        for api_version, kind in stale:
            # Not found (or KEDA's CRDs not installed): nothing of it to delete.
            await kube.delete(api_version, kind, meta["namespace"], meta["name"], uid=None)
        if wanted is not None:
            await kube.apply(wanted)
            log.info("autoscaling %s/%s: engine %s: applied its %s", *_who(meta), autoscaling.engine, wanted["kind"])
            if (body.get("spec") or {}).get("replicas") is None:
                # An HPA reads replicas 0 as "autoscaling disabled": the starting point is written once; then only
                # the engine writes it.
                await kube.merge_patch(
                    API_VERSION,
                    self.adapter.kind,
                    meta["namespace"],
                    meta["name"],
                    {
                        "metadata": {"resourceVersion": meta["resourceVersion"]},
                        "spec": {"replicas": engines.starting_replicas(body)},
                    },
                    subresource="scale",
                    field_manager=FIELD_MANAGER,
                )
            post_events(body, [Event("Normal", "AutoscalerApplied", f"engine {autoscaling.engine}: {wanted['kind']}")])
        return Memory(uid, engine=autoscaling.engine)

    async def _report(
        self,
        body: Manifest,
        autoscaling: Autoscaling,
        decision: Decision,
        resource_version: str,
        reported: AutoscalingStatus | None,
    ) -> AutoscalingStatus:
        """Write status.autoscaling and MetricsAvailable where they changed; post the decision's events."""
        meta = body["metadata"]
        previous_autoscaling, previous_conditions = _previous(body.get("status") or {})
        before = next((c for c in previous_conditions if c.type == METRICS_AVAILABLE), None)
        after = metrics_condition(autoscaling.metric, decision, meta.get("generation"))
        conditions = set_condition(list(previous_conditions), after)
        status = autoscaling_status(autoscaling, decision, reported or previous_autoscaling)
        patch: Manifest = {}
        if status != previous_autoscaling:
            # Every field, unset ones as null: a merge patch removes what is no longer known (the value in an outage).
            patch["autoscaling"] = status.model_dump(by_alias=True, mode="json")
        if before is None or (before.status, before.reason, before.message) != (
            after.status,
            after.reason,
            after.message,
        ):
            patch["conditions"] = [c.to_wire() for c in conditions]
        if patch:
            try:
                await kube.merge_patch(
                    API_VERSION,
                    self.adapter.kind,
                    meta["namespace"],
                    meta["name"],
                    {"metadata": {"resourceVersion": resource_version}, "status": patch},
                    subresource="status",
                    field_manager=FIELD_MANAGER,
                )
            except kube.Conflict:
                # The reconcile pass wrote the status meanwhile: the next round writes this again.
                log.debug("status of %s/%s changed meanwhile; reported next round", meta["namespace"], meta["name"])
        events = decision_events(decision, before, after)
        post_events(body, [Event(kind, reason, message) for kind, reason, message in events])
        return status


def _previous(status: Manifest) -> tuple[AutoscalingStatus | None, list[Condition]]:
    """status.autoscaling and the conditions as written (the same fields on every autoscaled kind); what does not
    parse (another version wrote it) is started afresh."""
    try:
        autoscaling = AutoscalingStatus.model_validate(status["autoscaling"]) if status.get("autoscaling") else None
    except ValidationError:
        autoscaling = None
    conditions: list[Condition] = []
    for raw in status.get("conditions") or []:
        try:
            conditions.append(Condition.model_validate(raw))
        except ValidationError:
            continue
    return autoscaling, conditions


def _who(meta: Manifest) -> tuple[str, str]:
    return str(meta["namespace"]), str(meta["name"])


def register(settings: OperatorSettings, adapters: Iterable[KindAdapter]) -> list[Autoscaler]:
    """One autoscaler loop per kind (each kind's adapter, kinds/<kind>/adapter.py), sharing one Prometheus client."""
    shared: list[PrometheusClient] = []

    def prometheus() -> PrometheusClient | None:
        if not shared and settings.prometheus_url:
            shared.append(PrometheusClient(settings.prometheus_url))
        return shared[0] if shared else None

    return [_register_kind(settings, adapter, prometheus) for adapter in adapters]


def _register_kind(
    settings: OperatorSettings, adapter: KindAdapter, prometheus: Callable[[], PrometheusClient | None]
) -> Autoscaler:
    autoscaler = Autoscaler(settings, adapter=adapter, prometheus=prometheus)
    index = index_id(adapter)

    # Which objects the builtin engine scales; an object that stops being one (or is deleted) leaves the index,
    # and the next round forgets it.
    @kopf.index(GROUP, VERSION, adapter.plural, id=index)
    async def _autoscaled(
        namespace: str | None, name: str | None, spec: Any, **kwargs: Any
    ) -> dict[tuple[str, str], bool]:
        autoscaler.start(kwargs.get(index))
        if not autoscaled(dict(spec or {}), adapter):
            return {}
        return {(str(namespace), str(name)): True}

    return autoscaler
