"""The reconcile runner: when, and how often, a controller's pass runs for one object. Every controller uses it.

A controller supplies one coroutine, `reconcile(namespace, name)` (the skeleton in reconcile.py run over the kind's
Reconciler): a full, idempotent pass that reads the object
fresh from the API server (its status is the only memory) and converges everything about it. The runner adds:

- Serialisation: at most one pass per object at a time, whoever triggers it (its own watch events, those of its
  children, the periodic resync).
- Coalescing: triggers that arrive while a pass runs become ONE more pass after it; `trigger` then returns at
  once. The extra pass reads the object fresh, so it sees everything those triggers announced.
- Passes across every kind run at most PASS_SLOTS at once (pass_gate.py), an object's first pass ahead of the
  waiting others; a pass's clock starts when it gets its slot.
- Bounded passes: a pass longer than `timeout_s` is cancelled (a hung API call must not keep an object from
  ever being reconciled again); it and any exception are logged, never raised: one broken object never stalls
  the others, and the next trigger or resync retries it.
- A periodic resync that needs no finalizer: `resync(index)` starts, once, a plain task that triggers every
  object a Kopf index marks as due, each `interval_s`. Not a `kopf.timer`: Kopf puts a finalizer on objects
  with timers, which would keep an object (and its namespace) from being deleted while the operator is down.
  A round runs at most RESYNC_CONCURRENCY passes at once, longest unvisited first, and skips objects passed less
  than half an interval ago; passes that watch events ask for take no resync slot. So a thousand busy objects
  stretch their own rounds instead of starving a new object's first pass (measured: bench_steady_requests).
- Quiet objects: a pass may say its object is steady (`quiet`): nothing about it moves with the clock, and every
  change it waits for arrives as a trigger (a watch event, a poll's answer). The resync then leaves it alone until
  `quiet`'s deadline (a safety net); the mark is dropped when its next pass starts, and kept only if that pass says
  so again (a healthy running TrainingJob: kinds/trainingjob/pacing.py).
- No per-object memory outlives a pass (the time of its last pass and a quiet mark aside, dropped by `forget`).
  What a controller must remember per object between passes goes in a `LastSeen`, which drops an object when it
  is deleted (`forget`); `Runner.forget` drops a pending re-run.
- Observability: every pass is timed and its failure counted per kind, its log lines name the object
  (loom.operator.observability); the resync skips its rounds while this replica stands by (core.leadership).

How a new controller uses it (InferenceGraph, say):

    def register(settings: OperatorSettings) -> None:
        runner = Runner("InferenceGraph", one_pass, interval_s=settings.resync_interval_s,
                        timeout_s=settings.reconcile_timeout_s)
        own_kind_handlers(runner, "inferencegraphs", "loom_inferencegraphs")
        child_handlers(runner, "inferencegraph", ("apps", "v1", "deployments"))  # its router Deployment

`own_kind_handlers` registers what every kind needs for its own objects (a kind whose resync must skip idle
objects, a finished TrainingJob, passes `due`; more trigger fields go in `also_on`, work on deletion in `deleted`);
`child_handlers` reconciles the owner when one of its children (labelled by the render kit) changes. `Indexes`
hands a controller's Kopf indexes (its watch cache) to passes started by any trigger.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import kopf

from . import client as kube
from .kit import MANAGED_BY
from .leadership import LEADERSHIP
from .model import GROUP, VERSION
from .observability import reconciling
from .pass_gate import FIRST, GATE, LATER, PassGate
from .refusal import report_refusal

log = logging.getLogger("loom.operator.runner")

Key = tuple[str, str]  # (namespace, name)
Reconcile = Callable[[str, str], Awaitable[None]]
# Resync passes of one kind running at once (each mostly waits on the API server or a pod's progress endpoint).
RESYNC_CONCURRENCY = 8
DueIndex = Mapping[Key, Iterable[bool]]  # a Kopf index: (namespace, name) -> [due for the periodic resync]
V = TypeVar("V", bound=Hashable)


class Runner:
    """Runs `reconcile(namespace, name)` per object: serialised, coalesced, bounded, periodically resynced."""

    def __init__(self, kind: str, reconcile: Reconcile, *, interval_s: float, timeout_s: float,
                 resync_concurrency: int = RESYNC_CONCURRENCY, gate: PassGate = GATE) -> None:
        self.kind = kind
        self._gate = gate
        self._reconcile = reconcile
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Resync passes run at most this many at once, so passes a watch event asks for (a new object, a spec
        # change, a pod that failed) never queue behind a round of a thousand busy objects: they take no slot.
        self._resync_slots = asyncio.Semaphore(resync_concurrency)
        self._last_pass: dict[Key, float] = {}  # when each object's last pass ended (the loop's clock)
        self._quiet_until: dict[Key, float] = {}  # steady objects the resync skips until then (the loop's clock)
        self._busy: set[Key] = set()
        self._again: set[Key] = set()
        self._resync: asyncio.Task[None] | None = None
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._fired: set[asyncio.Task[None]] = set()  # passes started by a timer, referenced until done

    @property
    def tracked(self) -> frozenset[Key]:
        """Objects the runner holds any state for right now (a pass running or pending)."""
        return frozenset(self._busy | self._again)

    async def trigger(self, namespace: str, name: str) -> None:
        """Reconcile this object now, or once more after the pass already running for it."""
        key = (namespace, name)
        if key in self._busy:
            self._again.add(key)
            return
        self._busy.add(key)
        try:
            while True:
                self._again.discard(key)
                await self._pass(namespace, name)
                self._last_pass[key] = asyncio.get_running_loop().time()
                if key not in self._again:
                    break
        finally:
            self._busy.discard(key)
            self._again.discard(key)

    async def _pass(self, namespace: str, name: str) -> None:
        # A slot first (pass_gate.py: bounded across kinds, an object's first pass ahead), then the timed pass.
        priority = FIRST if (namespace, name) not in self._last_pass else LATER
        async with self._gate.slot(priority):
            self._quiet_until.pop((namespace, name), None)  # only the pass that starts now may say it again
            await self._timed_pass(namespace, name)

    async def _timed_pass(self, namespace: str, name: str) -> None:
        # Timed and counted per kind; every line logged during the pass names the object (observability.py).
        with reconciling(self.kind, namespace, name) as outcome:
            try:
                await asyncio.wait_for(self._reconcile(namespace, name), timeout=self.timeout_s)
            except kube.OwnerGone as gone:
                # The object was deleted while the pass ran (it read the object before): nothing to converge, and
                # nothing wrong. kube.apply refused to re-create its child (see there); the pass simply ends.
                log.info("%s %s/%s was deleted during its pass; abandoned it (%s)", self.kind, namespace, name, gone)
            except kube.NameTaken as taken:
                # The same every pass until the other object goes or one is renamed: said in status, not a traceback.
                outcome.failed("name_taken")
                log.warning("%s %s/%s: %s", self.kind, namespace, name, taken)
                await report_refusal(self.kind, namespace, name, str(taken), reason="NameTaken")
            except TimeoutError:
                outcome.failed("timeout")
                log.error("reconciling %s %s/%s took over %gs; abandoned", self.kind, namespace, name, self.timeout_s)
            except Exception as exc:
                outcome.failed("exception")
                log.exception("reconciling %s %s/%s failed", self.kind, namespace, name)
                refused = kube.refusal(exc)
                if refused is not None:  # a child the API server refuses: the object says so (refusal.py)
                    await report_refusal(self.kind, namespace, name, refused)

    def later(self, namespace: str, name: str, delay_s: float) -> None:
        """Another pass for this object in `delay_s` seconds (the earliest one asked wins); for a kind whose state
        moves with time (a canary analysis' next evaluation) sooner than the periodic resync would come."""
        key = (namespace, name)
        loop = asyncio.get_running_loop()
        due = loop.time() + max(0.0, delay_s)
        current = self._timers.get(key)
        if current is not None and current[0] <= due:
            return
        if current is not None:
            current[1].cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            task = loop.create_task(self.trigger(namespace, name))
            self._fired.add(task)
            task.add_done_callback(self._fired.discard)

        self._timers[key] = (due, loop.call_at(due, fire))

    def quiet(self, namespace: str, name: str, for_s: float) -> None:
        """The running pass found its object steady: the periodic resync skips it for `for_s` seconds (triggers
        still run its passes). Called from inside the pass; the next pass to start drops the mark."""
        self._quiet_until[(namespace, name)] = asyncio.get_running_loop().time() + for_s

    def forget(self, namespace: str, name: str) -> None:
        """The object was deleted: a pass queued behind the running one is dropped."""
        self._again.discard((namespace, name))
        self._last_pass.pop((namespace, name), None)
        self._quiet_until.pop((namespace, name), None)
        timer = self._timers.pop((namespace, name), None)
        if timer is not None:
            timer[1].cancel()

    def resync(self, index: DueIndex | None) -> None:
        """Start the periodic resync over `index` (the first call wins; later calls are no-ops)."""
        if index is None or self._resync is not None:
            return
        self._resync = asyncio.get_running_loop().create_task(self._resync_forever(index))

    async def stop(self) -> None:
        """Stop the periodic resync (tests; the operator's loop ends with the process)."""
        task, self._resync = self._resync, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _resync_forever(self, index: DueIndex) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not await LEADERSHIP.leads():  # a replica standing by (Kopf peering): its handlers are paused too
                continue
            try:
                flagged = [key for key, flags in list(index.items()) if any(flags)]
            except Exception:  # an index changing under us: take the next round
                log.exception("reading the %s index for the resync failed", self.kind)
                continue
            now = asyncio.get_running_loop().time()
            due = resync_order(flagged, self._last_pass, now, self.interval_s, self._quiet_until)
            await asyncio.gather(*(self._resync_pass(key) for key in due))

    async def _resync_pass(self, key: Key) -> None:
        async with self._resync_slots:
            await self.trigger(*key)


def resync_order(
    flagged: Iterable[Key],
    last_pass: Mapping[Key, float],
    now: float,
    interval_s: float,
    quiet_until: Mapping[Key, float] | None = None,
) -> list[Key]:
    """The objects a resync round visits, longest unvisited first (under load a round takes longer than its
    interval, and nobody waits more than one round). One whose last pass, for whatever reason, ended less than
    half an interval ago is left for the next round: its state is fresh, and under churn most objects are. One
    its last pass found steady is left alone until its quiet mark runs out."""
    fresh = now - interval_s / 2
    quiet = quiet_until or {}
    due = [key for key in flagged if last_pass.get(key, float("-inf")) <= fresh and quiet.get(key, now) <= now]
    return sorted(due, key=lambda key: last_pass.get(key, float("-inf")))


def own_kind_handlers(
    runner: Runner,
    plural: str,
    index_id: str,
    *,
    also_on: Iterable[tuple[str, ...]] = (),
    due: Callable[[kopf.Body], bool] | None = None,
    deleted: Callable[[str, str, Mapping[str, Any]], Awaitable[None]] | None = None,
) -> None:
    """The Kopf handlers for a controller's own kind, none needing a finalizer: an object seen for the first time
    (created, or there when the operator starts), a spec change (a new metadata.generation) or a change of a field
    in `also_on` triggers a pass; a deletion drops a queued pass and calls `deleted` (namespace, name, spec) if
    given; an index of every object feeds the periodic resync, each object due at every round unless `due` says it
    is idle (Kopf passes the index to handlers as the kwarg `index_id`).

    Why a plain event handler and not Kopf's create/update/resume handlers: those keep Kopf's record of the last
    handled spec in an annotation, which costs every new object and every spec change a PATCH of the object (and
    the watch event it causes) and a deep copy of the body on every event; a burst of 200 TrainingJobs spent a
    tenth of the operator's CPU on it. The generation, which the API server moves on every spec change, says the
    same; the last one seen is kept per object until it is deleted."""
    seen: LastSeen[tuple[Any, ...]] = LastSeen()

    @kopf.on.event(GROUP, VERSION, plural, id="changed")
    async def changed(
        type: str | None, body: kopf.Body, namespace: str | None, name: str, spec: Mapping[str, Any], **kwargs: Any
    ) -> None:
        key = (str(namespace), name)
        if type == "DELETED":
            seen.forget(key)
            runner.forget(*key)
            if deleted is not None:
                await deleted(str(namespace), name, spec)
            return
        runner.resync(kwargs.get(index_id))
        if seen.changed(key, trigger_fields(body, also_on)):
            await runner.trigger(*key)

    # Every handler is async, indexes too, though pure: Kopf runs a sync one in a worker thread per event (a thread
    # hop and a context copy; unit test test_every_handler_runs_on_the_event_loop).
    @kopf.index(GROUP, VERSION, plural, id=index_id)
    async def index(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Key, bool]:
        return {(str(namespace), str(name)): True if due is None else due(body)}


def trigger_fields(body: Mapping[str, Any], also_on: Iterable[tuple[str, ...]] = ()) -> tuple[Any, ...]:
    """What a pass is triggered by when it changes: the generation (moved by the API server on every change of the
    spec, not of status or metadata), then the value at each path in `also_on` (None where absent)."""
    values: list[Any] = [(body.get("metadata") or {}).get("generation")]
    for path in also_on:
        value: Any = body
        for part in path:
            value = value.get(part) if isinstance(value, Mapping) else None
        values.append(value)
    return tuple(values)


def child_handlers(runner: Runner, kind_label: str, *resources: tuple[str, str, str]) -> None:
    """Reconcile the owner whenever one of its children of these (group, version, plural) changes, e.g. a
    Deployment's rollout progressing. Children carry the kit's labels: app.kubernetes.io/name=<kind_label> and
    loom.dev/<kind_label>=<owner name>."""

    async def child_changed(body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata", {})
        owner = (meta.get("labels") or {}).get(f"loom.dev/{kind_label}")
        if owner and meta.get("namespace"):
            await runner.trigger(meta["namespace"], owner)

    for group, version, plural in resources:
        kopf.on.event(group, version, plural, labels={"app.kubernetes.io/name": kind_label}, id=f"{kind_label}-child")(
            child_changed
        )


def watch_objects() -> None:
    """Keep the kube layer's watch cache current (core/watch_cache.py): Loom's own objects, and every child of a
    kind in CACHED_CHILDREN (Deployment, Service, ConfigMap, Job, LeaderWorkerSet) labelled as Loom's, as the watch
    delivers them. Registered once, for every kind
    (controllers.register); Kopf shares each resource's watch stream between its handlers."""

    async def seen(event: Mapping[str, Any], **_: Any) -> None:
        body = event.get("object")
        if isinstance(body, Mapping) and (body.get("metadata") or {}).get("name"):
            kube.WATCHED.seen(event.get("type"), dict(body))

    def watch(api_version: str, kind: str, labels: dict[str, str] | None) -> None:
        group, _, version = api_version.rpartition("/")
        plural = kube.resource(api_version, kind).plural
        kopf.on.event(group, version, plural, labels=labels, id=f"watch-cache-{plural}")(seen)

    for api_version, kind in kube.CACHED_OBJECTS:
        watch(api_version, kind, None)
    for api_version, kind in kube.CACHED_CHILDREN:
        watch(api_version, kind, {"app.kubernetes.io/managed-by": MANAGED_BY})


class Indexes:
    """Kopf's in-memory indexes a controller's passes read (its watch cache), bound once when the operator starts:
    Kopf hands every handler, start-up handlers included, the same live index objects, so a pass started by any
    trigger (a handler, the resync) reads the same ones, handed in explicitly instead of kept from the last call."""

    def __init__(self, *ids: str) -> None:
        self.ids = ids
        self._bound: dict[str, Any] = {}

    def register(self) -> None:
        """Bind the indexes at start-up (call from `register`, after the `kopf.index` handlers)."""

        async def bind(**kwargs: Any) -> None:
            self.bind(kwargs)

        kopf.on.startup(id=f"bind-indexes-{'-'.join(self.ids)}")(bind)

    def bind(self, kwargs: Mapping[str, Any]) -> None:
        for index_id in self.ids:
            if index_id in kwargs:
                self._bound[index_id] = kwargs[index_id]

    def get(self, index_id: str) -> Any:
        """The index, or None before start-up bound it."""
        return self._bound.get(index_id)


class LastSeen(Generic[V]):
    """The last value seen per object, for a handler that acts only when a few fields of a watched object change
    (e.g. a TrainingJob's latest checkpoint); an object is dropped when it is deleted, so memory stays bounded."""

    def __init__(self) -> None:
        self._values: dict[Key, V] = {}

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def changed(self, key: Key, value: V) -> bool:
        """Record `value` for `key`; True when it differs from the one recorded before (or none was)."""
        if key in self._values and self._values[key] == value:
            return False
        self._values[key] = value
        return True

    def forget(self, key: Key) -> None:
        self._values.pop(key, None)


def register_pod_index(kind_label: str, index_id: str) -> None:
    """Index the pods of one kind's objects by (namespace, owner name); Kopf passes it as the kwarg `index_id`."""
    owner_label = f"loom.dev/{kind_label}"

    async def pods(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]] | None:
        owner = (body.metadata.labels or {}).get(owner_label)
        if not owner or not body.metadata.namespace:
            return None
        return {(str(body.metadata.namespace), str(owner)): dict(body)}

    kopf.index("pods", labels={"app.kubernetes.io/name": kind_label}, id=index_id)(pods)
