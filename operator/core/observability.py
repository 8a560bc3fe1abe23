"""The operator's own metrics and structured logs.

Metrics (prometheus_client's default registry, served on the metrics port by main.py through `serve_metrics`, on
`/metrics` only: every other path is a 404. prometheus_client's own start_http_server answers every path with 200
and the metrics text, so a pod on the node agent probing 127.0.0.1:8081 for its engine once took the operator for
one, #52):

- `loom_reconcile_duration_seconds{kind}` (histogram): one reconcile pass (controllers.runner), any outcome.
- `loom_reconcile_errors_total{kind, reason}`: passes that raised (`exception`), were abandoned (`timeout`) or found a
  child's name taken by another object's child (`name_taken`, client.NameTaken).
- `loom_objects{kind, phase}` (gauge): objects of each kind per `status.phase` (`Unknown`: none yet).
- `loom_watch_restarts_total{resource, reason}`: watch streams re-opened after the first: `reconnect` (the
  stream ended: server timeout, dropped connection) or `relist` (listed again: 410 Gone, resume after a pause).
- `loom_leader` (gauge): 1 while this replica reconciles (standalone, or the active peer), 0 while it stands by.
- `loom_operator_event_loop_lag_seconds` (histogram): how late the event loop wakes a sleeping task (core/runtime.py).

The runner instruments every pass once (`reconciling`), so each controller is covered without code of its own.
`loom_objects` reads Kopf indices at scrape time: no API call per scrape, and exact as of the last watch event.
Kopf offers no hook for watch restarts; `count_watch_restarts` wraps the two functions of Kopf's watching module
that open a list and a watch (kopf._cogs.clients.watching), by name, so a Kopf release that renames them fails
tests/unit/test_observability.py instead of silently counting nothing.

Logs: `configure_logging` installs one stderr handler. Kopf's per-object loggers attach the object
(`k8s_ref`: apiVersion, kind, name, uid, namespace) to their records; the runner does the same for everything
logged during a pass through a context variable (`object_context`), which asyncio copies into the pass's task.
Format `json` prints one JSON object per line (python-json-logger, which Kopf depends on; the object under
`object`, as Kopf's own JSON format names it); `text` prefixes such lines with
`[Kind namespace/name]`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import kopf
import pythonjsonlogger.core
import pythonjsonlogger.json
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .model import GROUP, VERSION

log = logging.getLogger("loom.operator.observability")

RECONCILE_DURATION = Histogram(
    "loom_reconcile_duration_seconds",
    "Duration of one reconcile pass of an object, whatever its outcome.",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
RECONCILE_ERRORS = Counter(
    "loom_reconcile_errors",
    "Reconcile passes that raised (reason=exception) or were abandoned at the timeout (reason=timeout).",
    ["kind", "reason"],
)
WATCH_RESTARTS = Counter(
    "loom_watch_restarts",
    "Watch streams re-opened after the first one: reason=reconnect (the stream ended) or relist (listed again).",
    ["resource", "reason"],
)
LEADER = Gauge("loom_leader", "1 while this replica reconciles (standalone or the active peer), else 0.")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"

# The object the current reconcile pass is about (a Kubernetes object reference), or None.
current_object: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("loom_object", default=None)


def object_ref(kind: str, namespace: str | None, name: str) -> dict[str, str]:
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "name": name}
    if namespace:
        ref["namespace"] = namespace
    return ref


@contextlib.contextmanager
def object_context(kind: str, namespace: str | None, name: str) -> Iterator[None]:
    """Attach this object to every record logged inside the block (and in tasks created inside it)."""
    token = current_object.set(object_ref(kind, namespace, name))
    try:
        yield
    finally:
        current_object.reset(token)


class PassOutcome:
    def __init__(self) -> None:
        self.error: str | None = None

    def failed(self, reason: str) -> None:
        self.error = reason


@contextlib.contextmanager
def reconciling(kind: str, namespace: str, name: str) -> Iterator[PassOutcome]:
    """One reconcile pass: its duration and (when the caller marks it) its error are recorded; its log lines
    carry the object."""
    outcome = PassOutcome()
    started = time.perf_counter()
    with object_context(kind, namespace, name):
        try:
            yield outcome
        finally:
            RECONCILE_DURATION.labels(kind=kind).observe(time.perf_counter() - started)
            if outcome.error is not None:
                RECONCILE_ERRORS.labels(kind=kind, reason=outcome.error).inc()


# --- the metrics server -----------------------------------------------------------------------------------------

METRICS_PATH = "/metrics"

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def metrics_app(registry: CollectorRegistry = REGISTRY, path: str = METRICS_PATH) -> WsgiApp:
    """prometheus_client's WSGI app on `path` alone (its query string, e.g. name[]=, still filters); any other path
    is a 404, as a server that is not the one asked for should answer."""
    app = make_wsgi_app(registry)

    def only_metrics(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != path:
            body = f"not found: this is the Loom operator's metrics server, which serves {path} only\n".encode()
            start_response(
                "404 Not Found", [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
            )
            return [body]
        answer: Iterable[bytes] = app(environ, start_response)
        return answer

    return only_metrics


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the base class names it so
        pass


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve_metrics(port: int, host: str, registry: CollectorRegistry = REGISTRY) -> WSGIServer:
    """Serve `metrics_app` on host:port from a daemon thread (as prometheus_client.start_http_server does, for
    IPv4 and IPv6 hosts); returns the server (`shutdown()` stops it; its `server_port` is the port bound)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
    server: WSGIServer = make_server(host, port, metrics_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="loom-metrics", daemon=True).start()
    return server


# --- objects per phase ------------------------------------------------------------------------------------------

PhaseIndex = Mapping[str, Collection[Any]]  # a Kopf index: phase -> the objects in it


class ObjectsCollector(Collector):
    """`loom_objects{kind, phase}` from one Kopf index per kind, read when Prometheus scrapes."""

    def __init__(self) -> None:
        self._indices: dict[str, PhaseIndex] = {}

    def track(self, kind: str, index: PhaseIndex | None) -> None:
        if index is not None and kind not in self._indices:
            self._indices[kind] = index

    def counts(self) -> dict[tuple[str, str], int]:
        found: dict[tuple[str, str], int] = {}
        for kind, index in list(self._indices.items()):
            for _ in range(3):  # the index changes on Kopf's loop while a scrape thread reads it: read again
                try:
                    found.update({(kind, str(phase)): len(objects) for phase, objects in list(index.items())})
                    break
                except RuntimeError:
                    continue
        return found

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "loom_objects", "Objects of each Loom kind per status.phase.", labels=["kind", "phase"]
        )
        for (kind, phase), count in sorted(self.counts().items()):
            family.add_metric([kind, phase], count)
        yield family


OBJECTS = ObjectsCollector()


def phase_of(status: Mapping[str, Any] | None) -> str:
    phase = (status or {}).get("phase")
    return str(phase) if phase else "Unknown"


def register_phase_indices(kinds: Iterable[tuple[str, str]], registry: CollectorRegistry = REGISTRY) -> None:
    """A Kopf index per kind (phase -> objects) feeding `loom_objects`; call once, before the operator starts.

    `kinds`: (kind, plural) of each kind (main passes the API's registry: core/ never imports the kinds)."""
    registry.register(OBJECTS)
    for kind_name, plural in kinds:
        index_id = f"loom_phases_{plural}"

        async def phase(
            namespace: str | None,
            name: str | None,
            status: Mapping[str, Any],
            _kind: str = kind_name,
            _index_id: str = index_id,
            **kwargs: Any,
        ) -> dict[str, tuple[str, str]]:
            OBJECTS.track(_kind, kwargs.get(_index_id))
            return {phase_of(status): (str(namespace), str(name))}

        kopf.index(GROUP, VERSION, plural, id=index_id)(phase)


# --- watch restarts ---------------------------------------------------------------------------------------------


def resource_label(resource: Any) -> str:
    """plural.group of a Kopf resource (plural alone for the core group)."""
    plural, group = getattr(resource, "plural", str(resource)), getattr(resource, "group", "")
    return f"{plural}.{group}" if group else str(plural)


class WatchRestarts:
    """Counts Kopf's list+watch cycles per stream (resource, namespace): every list after the first is a relist;
    every watch request after the first of its list is a reconnect."""

    def __init__(self, counter: Counter = WATCH_RESTARTS) -> None:
        self._counter = counter
        self._listed: set[tuple[str, str | None]] = set()
        self._fresh: set[tuple[str, str | None]] = set()

    def listing(self, resource: Any, namespace: str | None) -> None:
        key = (resource_label(resource), namespace)
        if key in self._listed:
            self._counter.labels(resource=key[0], reason="relist").inc()
        self._listed.add(key)
        self._fresh.add(key)

    def watching(self, resource: Any, namespace: str | None) -> None:
        key = (resource_label(resource), namespace)
        if key in self._fresh:
            self._fresh.discard(key)
        else:
            self._counter.labels(resource=key[0], reason="reconnect").inc()


def count_watch_restarts(restarts: WatchRestarts | None = None) -> WatchRestarts:
    """Wrap Kopf's `continuous_watch` (list, then watch) and `watch_objs` (one watch request) so each call is
    counted. The wrappers return Kopf's own async generators unchanged: nothing else about watching changes."""
    from kopf._cogs.clients import watching

    restarts = restarts or WatchRestarts()

    def wrap(original: Callable[..., Any], seen: Callable[[Any, str | None], None]) -> Callable[..., Any]:
        if getattr(original, "__loom_counted__", False):
            original = original.__wrapped__  # type: ignore[attr-defined]

        def counted(*args: Any, **kwargs: Any) -> Any:
            seen(kwargs.get("resource"), kwargs.get("namespace"))
            return original(*args, **kwargs)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted.__loom_counted__ = True  # type: ignore[attr-defined]
        return counted

    watching.continuous_watch = wrap(watching.continuous_watch, restarts.listing)
    watching.watch_objs = wrap(watching.watch_objs, restarts.watching)
    return restarts


# --- logs -------------------------------------------------------------------------------------------------------


class ObjectContextFilter(logging.Filter):
    """Gives a record logged during a reconcile pass the pass's object, as Kopf's object loggers do."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "k8s_ref", None) is None:
            ref = current_object.get()
            if ref is not None:
                record.k8s_ref = ref
        return True


class TextFormatter(logging.Formatter):
    """The plain format, each line about an object prefixed with [Kind namespace/name] (as Kopf's text formatter
    prefixes [namespace/name])."""

    def format(self, record: logging.LogRecord) -> str:
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, Mapping):
            where = f"{ref.get('namespace')}/{ref.get('name')}" if ref.get("namespace") else str(ref.get("name"))
            record = copy.copy(record)  # shallow: other handlers see the message unchanged
            record.msg = f"[{ref.get('kind')} {where}] {record.msg}"
        return super().format(record)


class JsonFormatter(pythonjsonlogger.json.JsonFormatter):
    """One JSON object per line: time, level, logger, message, and the object (`object`: apiVersion, kind,
    namespace, name and, from Kopf's loggers, uid) when the line is about one. Kopf's internal record fields
    (its settings, its event-posting flag) stay out."""

    def __init__(self) -> None:
        super().__init__(
            JSON_FIELDS,
            rename_fields={"levelname": "level", "name": "logger", "asctime": "time"},
            reserved_attrs=[*pythonjsonlogger.core.RESERVED_ATTRS, "k8s_ref", "k8s_skip", "settings"],
        )

    def add_fields(self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_record, record, message_dict)
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, Mapping):
            log_record["object"] = {k: v for k, v in ref.items() if v is not None}


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {log_format!r} (text or json)")


def configure_logging(level: str, log_format: str) -> logging.Handler:
    """One stderr handler on the root logger (replacing any), with the object context and the chosen format."""
    handler = logging.StreamHandler()
    handler.addFilter(ObjectContextFilter())
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return handler
