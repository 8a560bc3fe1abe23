"""Operator churn: many mixed Loom objects reconciled while the operator is SIGKILLed at random moments.

Invariants the scenario measures (the e2e test asserts them, `make chaos` prints them at a larger scale):
- every object converges to the state a calm run reaches: the same phase and condition (type, status, reason), and
  the same owned children by kind and name (relative to the object's name), as one reference object of its kind
  reconciled by an operator nobody kills;
- no child is ever created twice while its owner exists: a watch started before the first object is created (list,
  then watch from the list's resourceVersion, so no event falls in a gap) records every uid ever ADDED per child
  kind and name; nor re-created after its owner was deleted (`recreated_after_owner_deleted`, reported apart: a pass
  that read its object just before the deletion; kube.apply re-checks the owner right before each apply), except
  within the one round trip between that check and the PATCH (`recreated_in_the_apply_window`, reported, and the
  garbage collector removes such a child again: the orphan check below);
- no orphan remains once the objects are deleted (with the operator killed once more during the deletion).

Pods land on kwok nodes (simulated) or are refused (graph routers, see kwok_only), so the storm is about the
controllers, the API server and the built-in controllers, not about real processes on this machine.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import kwok_placement
from loom.operator.core.model import GROUP, VERSION

from .kwok_only import kwok_only
from .registry import Figures, Run, scenario

LOOM_API = f"{GROUP}/{VERSION}"
PLURALS = {"TrainingJob": "trainingjobs", "InferenceService": "inferenceservices", "InferenceGraph": "inferencegraphs"}


def training_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": LOOM_API, "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
            "maxSteps": 100,
            "workers": {"replicas": 2, "gpusPerWorker": 0, **kwok_placement()},
            "checkpoint": {"uri": "s3://loom-chaos/ckpt", "secretRef": {"name": "s3-credentials"}},
        },
    }  # fmt: skip


def inference_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": LOOM_API, "kind": "InferenceService", "metadata": {"name": name},
        "spec": {"model": {"uri": f"s3://models/{name}/v1"}, "handler": "noop", "replicas": 2,
                 **kwok_placement()},
    }  # fmt: skip


def inference_graph(name: str, service: str) -> dict[str, Any]:
    nodes = {"root": {"routerType": "Sequence", "steps": [{"name": "only", "serviceName": service}]}}
    return {"apiVersion": LOOM_API, "kind": "InferenceGraph", "metadata": {"name": name},
            "spec": {"nodes": nodes, "router": {"replicas": 1}}}  # fmt: skip


def mixed_objects(count: int, tag: str) -> list[dict[str, Any]]:
    """`count` objects, cycling TrainingJob, InferenceService, InferenceGraph (each graph calls the service just
    before it, so graphs depend on objects created in the same storm)."""
    objects: list[dict[str, Any]] = []
    for i in range(count):
        match i % 3:
            case 0:
                objects.append(training_job(f"{tag}tj{i}"))
            case 1:
                objects.append(inference_service(f"{tag}is{i}"))
            case _:
                objects.append(inference_graph(f"{tag}ig{i}", f"{tag}is{i - 1}"))
    return objects


# ---- the watch of children ---------------------------------------------------------------------------------------

def _child_lists(api: client.ApiClient) -> dict[str, Callable[..., Any]]:
    core, apps, batch, rbac = (client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api),
                               client.RbacAuthorizationV1Api(api))
    return {
        "ConfigMap": core.list_namespaced_config_map, "Service": core.list_namespaced_service,
        "Pod": core.list_namespaced_pod, "ServiceAccount": core.list_namespaced_service_account,
        "Deployment": apps.list_namespaced_deployment, "Job": batch.list_namespaced_job,
        "CronJob": batch.list_namespaced_cron_job, "Role": rbac.list_namespaced_role,
        "RoleBinding": rbac.list_namespaced_role_binding,
    }  # fmt: skip


def _loom_owner(meta: Any) -> str | None:
    for ref in meta.owner_references or []:
        if ref.api_version == LOOM_API:
            return str(ref.name)
    return None


class CreationWatch:
    """Every uid ever ADDED per (kind, name) of a Loom-owned child in one namespace, from before the storm on."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.uids: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.created_at: dict[str, str] = {}  # uid -> creationTimestamp (for telling when a second one came)
        self.owner: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Barrier(len(_child_lists(api)) + 1)
        self._lists = _child_lists(api)

    def _note(self, kind: str, obj: Any) -> None:
        owner = _loom_owner(obj.metadata)
        if owner is None:
            return
        with self._lock:
            self.uids[(kind, obj.metadata.name)].add(obj.metadata.uid)
            self.created_at[obj.metadata.uid] = obj.metadata.creation_timestamp.isoformat()
            self.owner[(kind, obj.metadata.name)] = owner

    def _follow(self, kind: str, list_fn: Callable[..., Any]) -> None:
        first = True
        while not self._stop.is_set():
            try:
                listed = list_fn(self.namespace)
            except Exception:  # the API server restarting: try again
                time.sleep(0.5)
                continue
            for item in listed.items:
                self._note(kind, item)
            if first:
                first = False
                self._ready.wait()
            version = listed.metadata.resource_version
            try:
                # Short server-side timeouts: the loop notices the stop soon; resumes from the last version seen.
                while not self._stop.is_set():
                    for event in watch.Watch().stream(list_fn, self.namespace, resource_version=version,
                                                      timeout_seconds=5, allow_watch_bookmarks=True):
                        obj = event["object"]
                        version = obj.metadata.resource_version
                        if event["type"] == "ADDED":
                            self._note(kind, obj)
            except Exception:  # a 410 Gone, a dropped connection, the API server restarting
                time.sleep(0.5)  # re-list (which also catches anything ADDED meanwhile: its uid is in the list)

    def __enter__(self) -> CreationWatch:
        for kind, list_fn in self._lists.items():
            thread = threading.Thread(target=self._follow, args=(kind, list_fn), daemon=True, name=f"watch-{kind}")
            thread.start()
            self._threads.append(thread)
        self._ready.wait(timeout=60)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=15)

    def created_twice(self) -> dict[str, list[str]]:
        """Children ADDED with more than one uid: their creation times."""
        with self._lock:
            return {f"{kind}/{name}": sorted(self.created_at[u] for u in uids)
                    for (kind, name), uids in self.uids.items() if len(uids) > 1}

    def creations(self) -> int:
        with self._lock:
            return sum(len(uids) for uids in self.uids.values())


# ---- state of an object and its children -------------------------------------------------------------------------

def summary(obj: dict[str, Any]) -> tuple[Any, ...]:
    """What 'converged' means for one object: its phase and each condition's type, status and reason, for its
    current generation."""
    status = obj.get("status") or {}
    conditions = tuple(sorted((c["type"], c["status"], c.get("reason")) for c in status.get("conditions", [])))
    current = status.get("observedGeneration") == obj["metadata"].get("generation")
    return (status.get("phase"), conditions, current)


def _ready(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
    return bool(ready.get("status") == "True" and status.get("observedGeneration") == obj["metadata"]["generation"])


def children_of(api: client.ApiClient, namespace: str) -> dict[str, set[tuple[str, str]]]:
    """Loom-owned children now present, by owner name: {(kind, name with the owner's name as '{}')}."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for kind, list_fn in _child_lists(api).items():
        for item in list_fn(namespace).items:
            owner = _loom_owner(item.metadata)
            if owner is not None:
                found[owner].add((kind, item.metadata.name.replace(owner, "{}")))
    return found


def loom_objects(api: client.ApiClient, namespace: str) -> dict[str, dict[str, Any]]:
    custom = client.CustomObjectsApi(api)
    found = {}
    for kind, plural in PLURALS.items():
        for item in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]:
            found[item["metadata"]["name"]] = {**item, "kind": kind}
    return found


def create(api: client.ApiClient, namespace: str, obj: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURALS[obj["kind"]], obj)


def settled(api: client.ApiClient, namespace: str, names: list[str], quiet_s: float, timeout: float
            ) -> dict[str, tuple[Any, ...]]:
    """Wait until every object of `names` with a Ready condition has it True (a TrainingJob Running, a service
    rolled out; a graph whose router pods are refused never is), then until the summaries stop changing for
    `quiet_s`: the calm reference's end state."""

    def ready_where_possible() -> bool:
        objects = loom_objects(api, namespace)
        return all(objects[n]["kind"] == "InferenceGraph" or _ready(objects[n]) for n in names if n in objects)

    wait_until(ready_where_possible, timeout=timeout, what="the reference objects Ready", interval=0.5)
    last: dict[str, tuple[Any, ...]] = {}
    since = time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        objects = loom_objects(api, namespace)
        now = {n: summary(objects[n]) for n in names if n in objects}
        if now != last or not all(s[2] for s in now.values()):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.5)
    raise TimeoutError(f"reference objects did not settle: {last}")


# ---- the storm ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _namespace(cluster: Any, prefix: str) -> Iterator[str]:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "loom.dev/e2e=true")
    wait_until(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
               timeout=30, what=f"default ServiceAccount in {name}")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def log_errors(log: Path, last: int = 12) -> list[str]:
    """The operator log's last error and warning lines (a pass abandoned, an exception), cut to a readable width."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line[:300] for line in lines if " ERROR " in line or " WARNING " in line][-last:]


def churn(cluster: Any, workdir: Path, objects: int, kills: int, seed: int | None = None,
          interval_s: tuple[float, float] = (2.0, 5.0), timeout_s: float = 240) -> Figures:
    """Run the storm in a fresh namespace; return the figures and, under "problems", every broken invariant."""
    from loom.e2e.pytest_operator import apply_crds, operator_process

    rng = random.Random(seed)
    apply_crds(cluster)
    prefix = f"lc{uuid.uuid4().hex[:6]}"
    log = workdir / "operator-churn.log"
    problems: list[str] = []
    figures: Figures = {"objects": objects, "kills": kills}

    def operator() -> contextlib.AbstractContextManager[Any]:
        return operator_process(cluster, log, prefix=prefix)

    with cluster.api_client() as api, _namespace(cluster, prefix) as ns, kwok_only(api, ns):
        # The calm reference: one object of each kind (and the service its graph calls), nobody kills the operator.
        reference = mixed_objects(3, "ref")
        with operator():
            for obj in reference:
                create(api, ns, obj)
            calm = settled(api, ns, [o["metadata"]["name"] for o in reference], quiet_s=3, timeout=timeout_s)
        calm_children = children_of(api, ns)
        expected = {o["kind"]: (calm[o["metadata"]["name"]], calm_children[o["metadata"]["name"]])
                    for o in reference}
        figures["calm"] = {kind: f"{s[0]} {len(c)} children" for kind, (s, c) in expected.items()}

        storm = mixed_objects(objects, "c")
        started = time.monotonic()
        with CreationWatch(api, ns) as creations:
            killed = 0
            with operator() as op:
                for obj in storm:
                    create(api, ns, obj)
                time.sleep(rng.uniform(*interval_s))
                op.crash()
                killed += 1
            while killed < kills:
                with operator() as op:
                    time.sleep(rng.uniform(*interval_s))
                    op.crash()
                    killed += 1
            with operator() as op:
                def converged() -> bool:
                    objs = loom_objects(api, ns)
                    kids = children_of(api, ns)
                    return all(summary(objs[name]) == expected[o["kind"]][0]
                               and kids.get(name, set()) == expected[o["kind"]][1]
                               for o in storm if (name := o["metadata"]["name"]) in objs)

                try:
                    wait_until(converged, timeout=timeout_s, what="every object in its calm state", interval=1)
                except TimeoutError:
                    objs, kids = loom_objects(api, ns), children_of(api, ns)
                    for o in storm:
                        name = o["metadata"]["name"]
                        want_state, want_children = expected[o["kind"]]
                        if summary(objs[name]) != want_state or kids.get(name, set()) != want_children:
                            problems.append(f"{name}: {summary(objs[name])} with {sorted(kids.get(name, set()))}; "
                                            f"calm: {want_state} with {sorted(want_children)}")
                    # The CI log keeps only the assertion: carry the operator's own account of why into it.
                    figures["operator_log_errors"] = log_errors(log)
                figures["converged_s"] = round(time.monotonic() - started, 1)

                # Deletion, with one more kill in the middle of it.
                figures["deletion_started"] = datetime.now(UTC).isoformat()
                custom = client.CustomObjectsApi(api)
                for o in storm:
                    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURALS[o["kind"]],
                                                           o["metadata"]["name"])
                time.sleep(rng.uniform(0.2, 1.0))
                op.crash()
            with operator():
                storm_names = {o["metadata"]["name"] for o in storm}

                def gone() -> bool:
                    return not storm_names & set(loom_objects(api, ns)) and not storm_names & set(children_of(api, ns))

                try:
                    wait_until(gone, timeout=120, what="the objects and their children deleted", interval=1)
                except TimeoutError:
                    left = {k: sorted(v) for k, v in children_of(api, ns).items() if k in storm_names}
                    problems.append(f"left after deletion: objects {sorted(storm_names & set(loom_objects(api, ns)))}"
                                    f", children {left}")
            figures["operator_kills"] = killed + 1
            figures["children_created"] = creations.creations()
            twice = creations.created_twice()
        # A pass that read its object just before the deletion used to apply a child the garbage collector had just
        # removed: created again, owned by a uid that is gone, and collected again. kube.apply now checks the owner
        # right before each apply, so both kinds of second creation are failures, reported apart.
        # One window stays open: the owner check and the PATCH are one round trip apart (or an owner answer at most
        # 0.5 s old, watch_cache.py ALIVE_S, stands for the check), and an owner deleted in
        # between (with the garbage collector removing the child just as fast: seen in CI, both within 200 ms) lets
        # the PATCH create the child again, owned by the gone uid, and the collector removes it again ("left after
        # deletion" above proves it did). Re-creations inside that window are counted apart; any later one fails.
        # creationTimestamp has whole seconds, so the window is the deletion's second and the next.
        cut = figures["deletion_started"][:19]
        window_end = (datetime.fromisoformat(figures["deletion_started"]) + timedelta(seconds=1)).isoformat()[:19]
        figures["created_twice"] = {k: v for k, v in twice.items() if v[-1][:19] < cut}
        after = {k: v for k, v in twice.items() if v[-1][:19] >= cut}
        figures["recreated_in_the_apply_window"] = {k: v for k, v in after.items() if v[-1][:19] <= window_end}
        figures["recreated_after_owner_deleted"] = {k: v for k, v in after.items() if v[-1][:19] > window_end}
        if figures["created_twice"]:
            problems.append(f"children created more than once while their owner existed: {figures['created_twice']}")
        if figures["recreated_after_owner_deleted"]:
            problems.append(f"children re-created after their owner was deleted: "
                            f"{figures['recreated_after_owner_deleted']}")
        figures["per_kind"] = dict(Counter(o["kind"] for o in storm))
    figures["problems"] = problems
    return figures


@scenario("operator-churn", "mixed objects reconciled while the operator is SIGKILLed every few seconds")
def operator_churn(run: Run) -> Figures:
    if run.scale == "test":
        return churn(run.cluster, run.workdir, objects=12, kills=2, interval_s=(1.5, 3.5))
    return churn(run.cluster, run.workdir, objects=100, kills=10, timeout_s=600)
