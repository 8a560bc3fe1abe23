"""Prometheus metrics of the activator (its own registry; served on the admin port, never proxied)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: a wake is a pod start plus a model load, from about a second to many minutes.
WAKE_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)

Outcome = str  # forwarded | held_forwarded | timeout | overloaded | too_large | upstream_error | client_gone


class ActivatorMetrics:
    def __init__(self, service: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.service = service
        self.held = Gauge(
            "loom_activator_held_requests", "Requests held now, waiting for a Ready replica.",
            ["service"], registry=self.registry,
        )  # fmt: skip
        self.held_bytes = Gauge(
            "loom_activator_held_bytes", "Request bytes held now.", ["service"], registry=self.registry
        )
        self.requests = Counter(
            "loom_activator_requests", "Requests answered by the activator, by outcome.",
            ["service", "outcome"], registry=self.registry,
        )  # fmt: skip
        self.wakes = Counter(
            "loom_activator_wakes", "Times the activator asked for a replica (scale 0 -> 1).",
            ["service"], registry=self.registry,
        )  # fmt: skip
        self.wake_latency = Histogram(
            "loom_activator_wake_duration_seconds", "From asking for a replica to the first Ready one.",
            ["service"], buckets=WAKE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.hold_latency = Histogram(
            "loom_activator_hold_duration_seconds", "How long a request was held before it was forwarded or refused.",
            ["service"], buckets=WAKE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        # Label sets exist from the start, so a dashboard sees 0 rather than nothing.
        self.held.labels(service).set(0)
        self.held_bytes.labels(service).set(0)
        self.wakes.labels(service)

    def outcome(self, outcome: Outcome) -> None:
        self.requests.labels(self.service, outcome).inc()
