"""Prometheus metrics of the router.

Request metrics carry the model server's names, with the graph as the ``model`` label, so the
dashboards and autoscaling rules written for an InferenceService read a graph unchanged. Per-node and
per-step metrics follow the same style under ``loom_router_*``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..server.metrics import LATENCY_BUCKETS, RequestMetrics


class RouterMetrics(RequestMetrics):
    """All router metrics, in their own registry (one per app, so tests can build many apps)."""

    def __init__(self, graph: str, registry: CollectorRegistry | None = None):
        super().__init__(graph, registry or CollectorRegistry())
        self.graph = graph
        self.node_latency = Histogram(
            "loom_router_node_duration_seconds", "Time one node of the graph took.",
            ["graph", "node", "router_type"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.node_errors = Counter(
            "loom_router_node_errors", "Nodes that failed, by error code.",
            ["graph", "node", "code"], registry=self.registry,
        )
        self.step_latency = Histogram(
            "loom_router_step_duration_seconds",
            "Time one step took (for a streaming step: until its first event).",
            ["graph", "node", "step", "target"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.step_errors = Counter(
            "loom_router_step_errors", "Steps that failed, by error code and dependency.",
            ["graph", "node", "step", "code", "dependency"], registry=self.registry,
        )
        self.route = Counter(
            "loom_router_route", "Steps chosen by Switch and Splitter nodes (and no_route for none).",
            ["graph", "node", "step"], registry=self.registry,
        )

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
