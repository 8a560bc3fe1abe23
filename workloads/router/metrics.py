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

        # The retrieval step (retrieve on a chat step): its own latency, what the store gave, and when it gave none.
        self.retrieval_latency = Histogram(
            "loom_router_retrieval_duration_seconds",
            "Time a retrieval step took to embed the question and search the vector store.",
            ["graph", "node", "step", "feature_view"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.retrieval_documents = Histogram(
            "loom_router_retrieval_documents",
            "Documents a retrieval step put into the prompt (after filters, threshold and budget).",
            ["graph", "node", "step", "feature_view"], buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 50),
            registry=self.registry,
        )
        self.retrieval_empty = Counter(
            "loom_router_retrieval_empty",
            "Retrievals that put no document into the prompt (nothing near enough, or all filtered out).",
            ["graph", "node", "step", "feature_view"], registry=self.registry,
        )
        self.retrieval_failures = Counter(
            "loom_router_retrieval_failures",
            "Retrievals that failed (embedding service or store), by what the step did: failed or degraded "
            "(answered without context).",
            ["graph", "node", "step", "feature_view", "outcome"], registry=self.registry,
        )

    def retrieved(
        self, node: str, step: str, feature_view: str, seconds: float, documents: int | None, degraded: bool
    ) -> None:
        """One retrieval: ``documents`` None when it failed (``degraded``: the step answered without context)."""
        labels = (self.graph, node, step, feature_view)
        self.retrieval_latency.labels(*labels).observe(seconds)
        if documents is None:
            self.retrieval_failures.labels(*labels, "degraded" if degraded else "failed").inc()
            return
        self.retrieval_documents.labels(*labels).observe(documents)
        if documents == 0:
            self.retrieval_empty.labels(*labels).inc()

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
