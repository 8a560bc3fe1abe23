"""Prometheus metrics of the router.

Request metrics carry the model server's names, with the graph as the ``model`` label, so the
dashboards and autoscaling rules written for an InferenceService read a graph unchanged. Per-node and
per-step metrics follow the same style under ``loom_router_*``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    """All router metrics, in their own registry (one per app, so tests can build many apps)."""

    def __init__(self, graph: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.graph = graph
        self.request_latency = Histogram(
            "loom_server_request_duration_seconds",
            "Time from receiving a request to sending its response.",
            ["model", "endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "loom_server_requests", "Requests answered, by endpoint and HTTP status code.",
            ["model", "endpoint", "code"], registry=self.registry,
        )
        self.errors = Counter(
            "loom_server_request_errors", "Requests answered with an error, by HTTP status code.",
            ["model", "code"], registry=self.registry,
        )
        self.inflight = Gauge(
            "loom_server_inflight_requests", "Requests being handled now (running or streaming).",
            ["model"], registry=self.registry,
        )
        self.node_latency = Histogram(
            "loom_router_node_duration_seconds", "Time one node of the graph took.",
            ["graph", "node", "router_type"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.node_errors = Counter(
            "loom_router_node_errors", "Nodes that failed, by error code.",
            ["graph", "node", "code"], registry=self.registry,
        )
        self.step_latency = Histogram(
            "loom_router_step_duration_seconds",
            "Time one step took (for a streaming step: until its first event).",
            ["graph", "node", "step", "target"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.step_errors = Counter(
            "loom_router_step_errors", "Steps that failed, by error code and dependency.",
            ["graph", "node", "step", "code", "dependency"], registry=self.registry,
        )
        self.route = Counter(
            "loom_router_route", "Steps chosen by Switch and Splitter nodes (and no_route for none).",
            ["graph", "node", "step"], registry=self.registry,
        )

    def answered(self, endpoint: str, code: int, seconds: float) -> None:
        self.request_latency.labels(self.graph, endpoint).observe(seconds)
        self.requests.labels(self.graph, endpoint, str(code)).inc()
        if code >= 400:
            self.errors.labels(self.graph, str(code)).inc()

    def node_done(self, node: str, router_type: str, seconds: float, code: str | None) -> None:
        self.node_latency.labels(self.graph, node, router_type).observe(seconds)
        if code is not None:
            self.node_errors.labels(self.graph, node, code).inc()

    def step_done(
        self, node: str, step: str, target: str, seconds: float, code: str | None, dependency: str
    ) -> None:
        self.step_latency.labels(self.graph, node, step, target).observe(seconds)
        if code is not None:
            self.step_errors.labels(self.graph, node, step, code, dependency).inc()

    def routed(self, node: str, step: str) -> None:
        self.route.labels(self.graph, node, step).inc()
