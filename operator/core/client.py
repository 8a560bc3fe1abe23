"""The only place that talks to the API server.

Children are written with server-side apply under one field manager, so re-running a handler is a no-op
and a human edit to a field Loom owns is corrected. Calls go through `kubernetes_asyncio` on Kopf's event loop
(aiohttp, which Kopf already runs on): no thread pool for a pass to queue for, and every request has a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import aiohttp.helpers
import kubernetes_asyncio
import yarl
from kubernetes_asyncio.client.exceptions import ApiException

from ..settings import FIELD_MANAGER
from .kit import MANAGED_BY, taken_by
from .model import Manifest as Manifest  # re-exported: the kube layer's callers use kube.Manifest
from .watch_cache import WatchCache, key_of, version_of

log = logging.getLogger("loom.kube")

# Every request has a deadline: without one a request the API server never answers holds its pass forever, and
# the pass can only be abandoned (by the runner's pass timeout), never finished. Reads of a few hundred objects
# take well under a second; the read bound is for an API server under heavy load.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
# Connections to the API server held open at once. The calls of many passes run together on the event loop (the
# sync client's threads once made them queue: under load a pass spent its whole timeout waiting for a thread, was
# abandoned before its status write, and its object never showed a status; the operator-churn chaos test, in CI).
# Four per pass slot (pass_gate.PASS_SLOTS): a pass applies several children at once (a new TrainingJob's Service
# and ConfigMap, then all its worker pods), and with one connection per slot those waited for each other inside the
# client (P1 with 200 jobs, bench/bench_kubeflow_p1.py, 2026-11-27, with the Service, ConfigMap and pods applied
# together: per-job p99 1.27-3.42 s with 32, 1.23-2.07 s with 128). The API server bounds what it serves at once
# itself (400 reads, 200 writes by default).
KUBE_CONNECTIONS = 128
# Every connection is HTTPS, and a new one costs a TLS handshake on both ends (the API server verifies the client's
# certificate chain, the operator the server's) on the way to the request that needed it. In a burst of 200
# TrainingJobs (P1), the first fifth of the jobs waited longest for their pods in five rounds of six (p50 0.39-0.73
# s, the later fifths' 0.25-0.51 s) while the operator opened its first 40 connections; with WARM_CONNECTIONS
# opened at start-up, 0.24-0.35 s in five rounds of five, no longer the slowest. Kept open across a quiet minute
# instead of aiohttp's 15 s, so a burst after a pause finds them too; below the API server's own idle limit (90 s),
# so the operator closes an idle one first and never sends a request down one the server is closing.
WARM_CONNECTIONS = 32  # one per pass slot (pass_gate.PASS_SLOTS): a burst's first passes each find one open
KEEPALIVE_S = 60.0


@dataclass(frozen=True)
class Resource:
    api_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


# Every kind Loom reads or writes. A fixed table instead of discovery: no start-up round trips, no surprises.
RESOURCES: dict[tuple[str, str], Resource] = {
    ("v1", "Pod"): Resource("v1", "pods"),
    ("v1", "Service"): Resource("v1", "services"),
    ("v1", "ConfigMap"): Resource("v1", "configmaps"),
    ("v1", "Secret"): Resource("v1", "secrets"),
    ("v1", "Event"): Resource("v1", "events"),
    ("v1", "Node"): Resource("v1", "nodes", namespaced=False),
    ("v1", "Namespace"): Resource("v1", "namespaces", namespaced=False),
    ("v1", "PersistentVolumeClaim"): Resource("v1", "persistentvolumeclaims"),
    ("v1", "ServiceAccount"): Resource("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "Role"): Resource("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): Resource("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("apps/v1", "Deployment"): Resource("apps/v1", "deployments"),
    ("apps/v1", "ReplicaSet"): Resource("apps/v1", "replicasets"),
    # LeaderWorkerSet: an InferenceService replica larger than one pod (inferenceservice/llm/multinode.py).
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): Resource("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    ("batch/v1", "Job"): Resource("batch/v1", "jobs"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): Resource("autoscaling/v2", "horizontalpodautoscalers"),
    ("keda.sh/v1alpha1", "ScaledObject"): Resource("keda.sh/v1alpha1", "scaledobjects"),
    # GIE's InferencePool (inferenceservice/traffic/pool.py): a routed vllm service's, read before it is applied.
    ("inference.networking.k8s.io/v1", "InferencePool"): Resource("inference.networking.k8s.io/v1", "inferencepools"),
    ("batch/v1", "CronJob"): Resource("batch/v1", "cronjobs"),
    # The Lease a routed vllm service's picker pods elect their leader with (inferenceservice/traffic/picker.py).
    ("coordination.k8s.io/v1", "Lease"): Resource("coordination.k8s.io/v1", "leases"),
    ("discovery.k8s.io/v1", "EndpointSlice"): Resource("discovery.k8s.io/v1", "endpointslices"),
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): Resource("scheduling.volcano.sh/v1beta1", "podgroups"),
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): Resource("scheduling.x-k8s.io/v1alpha1", "podgroups"),
    ("loom.dev/v1alpha1", "TrainingJob"): Resource("loom.dev/v1alpha1", "trainingjobs"),
    ("loom.dev/v1alpha1", "InferenceService"): Resource("loom.dev/v1alpha1", "inferenceservices"),
    ("loom.dev/v1alpha1", "InferenceGraph"): Resource("loom.dev/v1alpha1", "inferencegraphs"),
    ("loom.dev/v1alpha1", "FeatureView"): Resource("loom.dev/v1alpha1", "featureviews"),
    # Kueue (core/queue/io.py): Loom creates and releases Workloads, reads flavors and priority classes.
    ("kueue.x-k8s.io/v1beta2", "Workload"): Resource("kueue.x-k8s.io/v1beta2", "workloads"),
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): Resource(
        "kueue.x-k8s.io/v1beta2", "resourceflavors", namespaced=False
    ),
    ("kueue.x-k8s.io/v1beta2", "WorkloadPriorityClass"): Resource(
        "kueue.x-k8s.io/v1beta2", "workloadpriorityclasses", namespaced=False
    ),
    # Kueue's visibility API: a LocalQueue's pending workloads, for a queued object's position.
    ("visibility.kueue.x-k8s.io/v1beta2", "LocalQueue"): Resource("visibility.kueue.x-k8s.io/v1beta2", "localqueues"),
    ("scheduling.k8s.io/v1", "PriorityClass"): Resource("scheduling.k8s.io/v1", "priorityclasses", namespaced=False),
    # Kopf peering (high availability): read by core/leadership.py.
    ("kopf.dev/v1", "ClusterKopfPeering"): Resource("kopf.dev/v1", "clusterkopfpeerings", namespaced=False),
}


# What Kopf streams into the watch cache (core/runner.py: watch_objects; core/watch_cache.py): Loom's own kinds, and
# the children labelled as Loom's. Reads of these are served from it; an apply of a child that would change nothing
# is skipped. Other kinds always go to the API server.
CACHED_CHILDREN: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"), ("batch/v1", "Job"),
    # A multi-pod replica's group (inferenceservice/llm/multinode.py). Where LeaderWorkerSet is not installed, Kopf
    # watches nothing for it and a GET's 404 is kept like any other absence (a one-pod service's canary track asks
    # for its `<track>-group` on every pass).
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
)
CACHED_OBJECTS: tuple[tuple[str, str], ...] = tuple(
    (api_version, kind) for api_version, kind in RESOURCES if api_version == "loom.dev/v1alpha1"
)
# Where a GET's "not found" is kept until the watch brings the object (watch_cache.py: is_absent): kinds the watch
# delivers whole (Loom's own) or whose names only Loom gives. Not Services or ConfigMaps: one of someone else's, not
# labelled as Loom's and so never in the watch, may take the name, and passes look for exactly that.
KNOWN_ABSENT: frozenset[tuple[str, str]] = frozenset(
    {*CACHED_OBJECTS, ("apps/v1", "Deployment"), ("batch/v1", "Job"),
     ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")}
)
WATCHED = WatchCache()


def resource(api_version: str, kind: str) -> Resource:
    try:
        return RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"loom does not manage {kind}.{api_version}") from None


class NotFound(Exception):
    pass


def refusal(exc: BaseException) -> str | None:
    """The API server's message when it refused a request as invalid (400, 422), else None. A pass that renders a
    child the API server refuses fails the same way every time: its object must say so in a condition."""
    if not isinstance(exc, ApiException) or exc.status not in (400, 422):
        return None
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or exc.reason)


class Conflict(Exception):
    pass


# What a request may fail with besides NotFound and Conflict: the API server's other answers (503 from an
# aggregated API that is down, 403) and the transport's errors (a deadline passed, a connection refused).
REQUEST_ERRORS: tuple[type[BaseException], ...] = (ApiException, aiohttp.ClientError, TimeoutError)


class NameTaken(Exception):
    """A child's name is another object's child (kit.taken_by): the apply is refused rather than taking it over;
    the object says so in its Ready condition (reason NameTaken, refusal.py) until the other one goes or is renamed."""


class OwnerGone(Exception):
    """A child's controlling owner no longer exists (404, or a namesake with another uid): the pass that rendered
    the child read its owner before the owner was deleted, and must stop applying (the runner ends it quietly)."""


# One client per event loop: its aiohttp session belongs to the loop it was made on (the operator has one; a test
# process makes a loop per test).
_clients: dict[asyncio.AbstractEventLoop, kubernetes_asyncio.client.ApiClient] = {}


async def api_client() -> kubernetes_asyncio.client.ApiClient:
    """The loop's shared client: in-cluster config inside a pod (its token re-read as the kubelet rotates it), the
    current kubeconfig elsewhere."""
    loop = asyncio.get_running_loop()
    if loop in _clients:
        return _clients[loop]
    configuration = kubernetes_asyncio.client.Configuration()
    try:
        kubernetes_asyncio.config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except kubernetes_asyncio.config.ConfigException:
        await kubernetes_asyncio.config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = KUBE_CONNECTIONS
    for gone in [other for other in _clients if other.is_closed()]:
        del _clients[gone]  # a finished test's loop: its session cannot be closed from this one
    made = without_environment_lookups(kubernetes_asyncio.client.ApiClient(configuration))
    connector = made.rest_client.pool_manager.connector
    if connector is not None:
        # aiohttp takes it only as TCPConnector's argument, and kubernetes_asyncio makes the connector itself.
        connector._keepalive_timeout = KEEPALIVE_S
    shared = _clients.setdefault(loop, made)
    if shared is not made:
        await made.close()  # another pass made the loop's client while this one read the configuration
    return shared


def without_environment_lookups(api: kubernetes_asyncio.client.ApiClient) -> kubernetes_asyncio.client.ApiClient:
    """The client's aiohttp session with `trust_env` off. kubernetes_asyncio turns it on, and aiohttp then reads
    ~/.netrc and the proxy variables again for every request, each in a worker thread: in a burst of 200 jobs that
    was an eighth of the operator's CPU (py-spy, bench_kubeflow_p1.py). A proxy from the environment
    (HTTPS_PROXY, NO_PROXY) is still honoured: looked up once here for the API server's address."""
    rest = api.rest_client
    session: aiohttp.ClientSession = rest.pool_manager
    if not session.trust_env:
        return api
    if rest.proxy is None:
        try:
            proxy, proxy_auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(api.configuration.host))
        except LookupError:  # no proxy for it
            pass
        else:
            rest.proxy = str(proxy)
            if proxy_auth is not None:
                rest.proxy_headers = {"Proxy-Authorization": proxy_auth.encode()}
    connector = session.connector
    session.detach()  # the connector (TLS context, connection limit) moves to the new session
    # read_bufsize as kubernetes_asyncio sets it: a watch event of a large object exceeds aiohttp's default.
    rest.pool_manager = aiohttp.ClientSession(connector=connector, trust_env=False, read_bufsize=2**21)
    return api


async def warm_up(connections: int = WARM_CONNECTIONS) -> int:
    """Open `connections` connections to the API server before the first pass needs them (see WARM_CONNECTIONS):
    as many GET /version at once (allowed to any authenticated client, answered from memory). Returns how many
    answered; one that fails is only a connection the first burst opens itself."""
    answers = await asyncio.gather(*(_call("GET", "/version") for _ in range(connections)), return_exceptions=True)
    failed = [answer for answer in answers if isinstance(answer, BaseException)]
    if failed:
        log.info("%d of %d warm-up requests to the API server failed: %s", len(failed), connections, failed[0])
    return connections - len(failed)


async def close() -> None:
    """Close the running loop's client (the operator's clean-up, so aiohttp has no open session left at exit)."""
    made = _clients.pop(asyncio.get_running_loop(), None)
    if made is not None:
        await made.close()


# Every answer is JSON (an object, a list, a Status) or empty: deserialized as a plain `object`, not a model.
_ANSWERS = {status: "object" for status in (200, 201, 202)}


async def _call(
    method: str,
    path: str,
    *,
    body: Any = None,
    query: list[tuple[str, Any]] | None = None,
    content_type: str = "application/json",
) -> Manifest | None:
    client = await api_client()
    try:
        data = await client.call_api(
            path,
            method,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
            response_types_map=_ANSWERS,
            _return_http_data_only=True,
            _request_timeout=aiohttp.ClientTimeout(
                connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
            ),
        )
    except ApiException as exc:
        if exc.status == 404:
            raise NotFound(path) from exc
        if exc.status == 409:
            raise Conflict(path) from exc
        raise
    return data if isinstance(data, dict) else None


# A parameter keeps the client from re-encoding the body (it json.dumps anything sent as exactly
# application/apply-patch+yaml); the API server ignores it.
APPLY_CONTENT_TYPE = "application/apply-patch+yaml; charset=utf-8"
# A JSON surrogate pair, not preceded by an escaped backslash.
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _yaml_escape(match: re.Match[str]) -> str:
    high, low = int(match.group(2), 16), int(match.group(3), 16)
    return f"{match.group(1)}\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08x}"


def apply_body(manifest: Manifest) -> bytes:
    """JSON for a server-side apply, which the API server parses as YAML: a character outside the BMP (an emoji in a
    description) is written as YAML's 32-bit escape, since YAML refuses JSON's surrogate-pair escapes (400, and the
    object was never reconciled)."""
    return _SURROGATE_PAIR.sub(_yaml_escape, json.dumps(manifest)).encode("ascii")


def _controller(manifest: Manifest) -> Manifest | None:
    """The manifest's controlling ownerReference, when it names a kind Loom knows (shared children, owned by
    several objects none of which controls them, have none)."""
    for ref in manifest["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and (ref.get("apiVersion"), ref.get("kind")) in RESOURCES:
            return dict(ref)
    return None


async def _owner_exists(namespace: str | None, ref: Manifest) -> bool:
    """The controlling owner `ref` still exists with the same uid: the API server said so within one round trip
    (watch_cache.py: alive, e.g. the pass's own status write), or a GET says so now."""
    key = (ref["apiVersion"], ref["kind"], namespace or "", ref["name"])
    if WATCHED.alive(key, ref["uid"], time.monotonic()):
        return True
    try:
        owner = await _call("GET", resource(ref["apiVersion"], ref["kind"]).path(namespace, ref["name"]))
    except NotFound:
        return False
    if owner is not None and key[:2] in CACHED_OBJECTS:
        WATCHED.answered(owner, time.monotonic())
    meta = owner["metadata"] if owner is not None else {}
    return bool(meta.get("uid") == ref["uid"] and not meta.get("deletionTimestamp"))


async def _require_owner(namespace: str | None, owner: Manifest | None) -> None:
    """OwnerGone unless the controlling owner `owner` (None: the child has none Loom knows) still exists."""
    if owner is not None and not await _owner_exists(namespace, owner):
        raise OwnerGone(f"{owner['kind']} {namespace}/{owner['name']} uid {owner['uid']}")


async def apply(
    manifest: Manifest, *, subresource: str | None = None, force: bool = True, owner_written_beside: bool = False
) -> Manifest:
    """Server-side apply `manifest` (create or converge) under Loom's field manager.

    A child (a manifest with a controlling ownerReference) is applied only while its owner still exists, same uid:
    a pass reads its object once, then may take seconds to reach its applies, and an apply after the owner's
    deletion re-creates a child the garbage collector had just removed (found by the operator-churn chaos test).
    Raises OwnerGone instead (also for an owner being deleted). The check and the PATCH go out back to back (with
    the sync client's thread pool an apply once queued for a thread between them, and the owner's deletion and the
    garbage collector fit in that wait: 3 of 347 children at report scale, load 15). The check is a GET, or an
    answer the API server gave for the owner at most ALIVE_S (0.5 s, a busy round trip) ago and no deletion seen
    since (watch_cache.py: alive; a TrainingJob's status write before its children and pods). The window left is
    that round trip; the garbage collector closes it, removing a child whose owner's uid is gone.

    `owner_written_beside`: the caller writes the owner at the same moment (a TrainingJob's status write beside its
    first children, reconcile.py `prepare`), and that write's answer stands for the check: it fails the pass on a
    gone owner, and a child it let through is owned by a uid that is gone, the same one-round-trip window."""
    res = resource(manifest["apiVersion"], manifest["kind"])
    owner = None if subresource or owner_written_beside else _controller(manifest)
    meta = manifest["metadata"]
    path = res.path(meta.get("namespace"), meta["name"], subresource)
    query = [("fieldManager", FIELD_MANAGER), ("force", "true" if force else "false")]
    body = apply_body(manifest)
    cached = subresource is None and (manifest["apiVersion"], manifest["kind"]) in CACHED_CHILDREN
    digest = hashlib.sha256(body + query[1][1].encode()).hexdigest()
    if cached:
        # The same manifest, applied already, and nobody wrote the child since: nothing to send (watch_cache.py).
        unchanged = WATCHED.unchanged(key_of(manifest), digest, time.monotonic())
        if unchanged is not None:
            return unchanged
        # Another object's child under the name (only Loom-labelled objects are in the cache: those are the ones
        # an apply under Loom's one field manager would silently take over).
        other = taken_by(WATCHED.body(key_of(manifest), time.monotonic()), manifest)
        if other is not None:
            raise NameTaken(
                f"{manifest['kind']} {meta['name']} belongs to {other.get('kind')} {other.get('name')}: an object "
                "of that name would take it over; rename one of them"
            )
    await _require_owner(meta.get("namespace"), owner)
    result = await _call("PATCH", path, body=body, query=query, content_type=APPLY_CONTENT_TYPE)
    assert result is not None
    if subresource is not None:
        WATCHED.wrote(key_of(manifest), version_of(result), time.monotonic(), answer=result)
    elif cached and _managed(result):
        WATCHED.applied(result, digest, time.monotonic())
    return result


async def create(manifest: Manifest) -> Manifest | None:
    """Create `manifest` (POST) under Loom's field manager, for a child Loom only ever creates (a TrainingJob's
    worker pods: a pod's spec cannot change, so there is nothing to converge). None when one of that name exists
    already: it is left as it is (a worker of the previous attempt still terminating is not relabelled into the new
    one; the pass after its deletion creates the new worker). Owner check as in `apply`.

    Cheaper than an apply for the API server: 400 pods created by POST against server-side apply, alternating,
    four rounds each: its CPU 2.83 against 3.58 s, etcd's 0.70 against 0.94 s (2026-11-28, bench/bench_kubeflow_p1
    .py's machine); an apply computes the whole object's field ownership, and the stored pod carries it."""
    res = resource(manifest["apiVersion"], manifest["kind"])
    meta = manifest["metadata"]
    await _require_owner(meta.get("namespace"), _controller(manifest))
    try:
        query = [("fieldManager", FIELD_MANAGER)]
        return await _call("POST", res.path(meta.get("namespace")), body=manifest, query=query)
    except Conflict:
        return None


async def get(
    api_version: str, kind: str, namespace: str | None, name: str, *, subresource: str | None = None
) -> Manifest | None:
    """The object (or one of its subresources), or None when it does not exist. Loom's objects and children are
    read from the watch cache when they are there (watch_cache.py: as the watch last delivered them); otherwise,
    subresources and other kinds, a GET."""
    key = (api_version, kind, namespace or "", name)
    cached = subresource is None and ((api_version, kind) in CACHED_CHILDREN or (api_version, kind) in CACHED_OBJECTS)
    if cached:
        body = WATCHED.body(key, time.monotonic())
        if body is not None:
            return body
        if WATCHED.is_absent(key, time.monotonic()):
            return None
    try:
        return await _call("GET", resource(api_version, kind).path(namespace, name, subresource))
    except NotFound:
        if cached and (api_version, kind) in KNOWN_ABSENT:
            WATCHED.absent(key, time.monotonic())
        return None


def _managed(body: Manifest) -> bool:
    """Labelled as Loom's: the watch that keeps the child cache current delivers only these."""
    return ((body.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/managed-by") == MANAGED_BY


async def list_objects(
    api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
) -> list[Manifest]:
    query = [("labelSelector", label_selector)] if label_selector else []
    result = await _call("GET", resource(api_version, kind).path(namespace), query=query)
    return list((result or {}).get("items", []))


async def delete(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str,
    *,
    grace_period_seconds: int | None = None,
    uid: str | None = None,
) -> bool:
    """Delete; True when something was deleted. `uid` guards against deleting a re-created namesake."""
    body: dict[str, Any] = {"propagationPolicy": "Background"}
    if grace_period_seconds is not None:
        body["gracePeriodSeconds"] = grace_period_seconds
    if uid:
        body["preconditions"] = {"uid": uid}
    WATCHED.forget((api_version, kind, namespace or "", name))
    try:
        await _call("DELETE", resource(api_version, kind).path(namespace, name), body=body)
    except (NotFound, Conflict):
        return False
    return True


async def patch_status(api_version: str, kind: str, namespace: str, name: str, status: Manifest) -> None:
    """Merge-patch the status subresource: the skeleton's status write (core/reconcile.py). As Loom's field manager:
    the status's managedFields name the operator (without it, the client library's default user agent)."""
    result = await merge_patch(api_version, kind, namespace, name, {"status": status}, subresource="status")
    if (api_version, kind) in CACHED_OBJECTS:
        WATCHED.answered(result, time.monotonic())  # it exists: the owner check of the children applied next


async def merge_patch(
    api_version: str,
    kind: str,
    namespace: str,
    name: str,
    body: Manifest,
    *,
    subresource: str | None = None,
    field_manager: str = FIELD_MANAGER,
) -> Manifest:
    """Merge-patch the object or one of its subresources (scale, status). A metadata.resourceVersion in `body`
    makes it conditional: Conflict when the object changed since it was read."""
    path = resource(api_version, kind).path(namespace, name, subresource)
    result = await _call(
        "PATCH",
        path,
        body=body,
        query=[("fieldManager", field_manager)],
        content_type="application/merge-patch+json",
    )
    # A scale's resourceVersion is its object's: until the watch brings this write back, reads are served the
    # object as this write left it, or for a scale (whose answer is not the object) go to the API server.
    WATCHED.wrote((api_version, kind, namespace, name), version_of(result), time.monotonic(), answer=result)
    assert result is not None
    return result
