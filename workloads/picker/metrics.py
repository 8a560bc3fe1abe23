"""Prometheus metrics of the picker (its own registry; served on the admin port, never proxied)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .scoring import REASONS

# The picker's own time per request (parse, hash, score): microseconds to a few milliseconds.
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class PickerMetrics:
    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.service = service
        self.decisions = Counter("loom_picker_decisions", "Requests routed, by the reason of the choice.",
                                 ["service", "reason"], registry=self.registry)
        self.latency = Histogram("loom_picker_decision_seconds",
                                 "The picker's own time to choose a replica (body parse, block hashes, scoring).",
                                 ["service"], buckets=DECISION_BUCKETS, registry=self.registry)
        self.predicted = Histogram("loom_picker_predicted_prefix_share",
                                   "Share of the prompt's blocks the chosen replica probably held.",
                                   ["service"], buckets=SHARE_BUCKETS, registry=self.registry)
        self.hit_ratio = Gauge("loom_picker_replica_prefix_cache_hit_ratio",
                               "Each replica's prefix-cache hit rate as its engine counts it (hits / queried "
                               "tokens, vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).",
                               ["service", "replica"], registry=self.registry)
        self.routed = Counter("loom_picker_requests", "Requests sent to each replica.", ["service", "replica"],
                              registry=self.registry)
        self.outcomes = Counter("loom_picker_outcomes", "Requests by outcome: forwarded, retried (a replica "
                                "refused the connection: another one was tried), no_replica (503), upstream_error "
                                "(502), too_large (413), shed (429: flow control, gate.py), client_gone.",
                                ["service", "outcome"], registry=self.registry)
        self.replicas = Gauge("loom_picker_replicas", "Replicas that can take requests, and overloaded ones.",
                              ["service", "state"], registry=self.registry)
        self.overloaded = Gauge("loom_picker_replica_overloaded", "1 while the picker holds a replica overloaded "
                                "(from its last readable /metrics): it gets nothing new.", ["service", "replica"],
                                registry=self.registry)
        self.chars_per_token = Gauge("loom_picker_chars_per_token", "Characters of prompt text per model token that "
                                     "cut prompts into the engine's blocks (learned from vllm:prompt_tokens_total "
                                     "unless fixed).", ["service"], registry=self.registry)
        self.disaggregation = Counter("loom_picker_disaggregation", "Generation requests of a disaggregated "
                                      "service by path: prefill+decode (prefilled on a prefill replica, then "
                                      "decoded), decode-only (the decode replica prefilled by itself), and why "
                                      "(prefilled, no_prefill_replica, prefill_failed).",
                                      ["service", "path", "reason"], registry=self.registry)
        for reason in REASONS:  # label sets exist from the start, so a dashboard sees 0 rather than nothing
            self.decisions.labels(service, reason)

    def outcome(self, outcome: str) -> None:
        self.outcomes.labels(self.service, outcome).inc()
