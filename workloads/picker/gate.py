"""Flow control's edge: the picker's requests wait at this gate for a place in flight (flow.FlowQueue decides).

`enter` classifies a request (tenant, priority) and returns once it may be routed, or raises `Shed` (the caller
answers 429 with Retry-After): shed by the queue, or waited past the bound. The caller calls `leave` exactly once
per request that entered, when its answer is done or abandoned. A client that goes away while waiting takes its
ticket out of the queue; one dispatched at the moment it went away gives its place back.

Both of the picker's modes go through it: the HTTP proxy around each forwarded request, the ext_proc service from
the request's headers to the end of its response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .config import FlowControlConfig, PickerConfig
from .flow import Arrival, FlowQueue, Ticket, priority_of, tenant_of
from .state import PickerState

# Tenants beyond this many get the label "other" (a tenant is any presented key: unbounded in principle).
MAX_TENANT_LABELS = 200
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Shed(Exception):
    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class FlowMetrics:
    def __init__(self, service: str, registry: CollectorRegistry) -> None:
        self.service = service
        self.registry = registry
        self.requests = Counter("loom_picker_flow_requests", "Requests under flow control by tenant, priority and "
                                "outcome: dispatched (at once or after waiting), shed (429: the queue was full), "
                                "expired (429: waited past the bound), withdrawn (the client went away waiting).",
                                ["service", "tenant", "priority", "outcome"], registry=registry)
        self.waiting = Gauge("loom_picker_flow_waiting", "Requests waiting for a place, by tenant and priority.",
                             ["service", "tenant", "priority"], registry=registry)
        self.wait = Histogram("loom_picker_flow_wait_seconds", "Time a dispatched request waited for its place.",
                              ["service", "priority"], buckets=WAIT_BUCKETS, registry=registry)
        self.inflight = Gauge("loom_picker_flow_inflight", "Requests in flight, and the places (capacity).",
                              ["service", "kind"], registry=registry)
        self._tenants: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        return "other"


class FlowGate:
    def __init__(self, config: FlowControlConfig, metrics: FlowMetrics, retry_after_s: int = 1,
                 replicas: int = 0) -> None:
        self.config = config
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.queue = FlowQueue(config.max_queued, self._capacity(replicas))
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._entered: dict[Ticket, float] = {}
        self._shown: set[tuple[str, int]] = set()
        self._export()

    def _capacity(self, replicas: int) -> int:
        # No replica ready counts as one: requests then meet the picker's own wait for a replica (and its 503)
        # rather than waiting here for a place that cannot come.
        return self.config.max_inflight_per_replica * max(1, replicas)

    def resize(self, replicas: int) -> None:
        self._settle(Arrival(dispatched=self.queue.resize(self._capacity(replicas))))

    def classify(self, headers: Mapping[str, str]) -> tuple[str, int]:
        tenant = tenant_of(headers, self.config.tenant_header)
        default = self.config.tenant_priorities.get(tenant, self.config.default_priority)
        return tenant, priority_of(headers, self.config.priority_header, default)

    async def enter(self, headers: Mapping[str, str]) -> Ticket:
        tenant, priority = self.classify(headers)
        ticket = self.queue.ticket(tenant, priority)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        self._entered[ticket] = time.monotonic()
        self._settle(self.queue.arrive(ticket))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=self.config.max_queue_wait_seconds)
        except TimeoutError:
            if self.queue.withdraw(ticket):
                self._forget(ticket)
                self._count(ticket, "expired")
                self._export()
                raise Shed(f"waited {self.config.max_queue_wait_seconds:g} s for a place", self.retry_after_s) \
                    from None
            # Settled at the same moment: its outcome is in the future.
        except asyncio.CancelledError:
            if self.queue.withdraw(ticket):
                self._forget(ticket)
                self._count(ticket, "withdrawn")
                self._export()
            elif future.done() and future.exception() is None:
                self.leave(ticket)  # dispatched as its client went: the place goes on to the next
            raise
        future.result()  # raises Shed when it was shed
        return ticket

    def leave(self, ticket: Ticket) -> None:
        self._settle(Arrival(dispatched=self.queue.release()))

    def _settle(self, arrival: Arrival) -> None:
        now = time.monotonic()
        for ticket in arrival.dispatched:
            self.metrics.wait.labels(self.metrics.service, str(ticket.priority)).observe(
                now - self._entered.get(ticket, now))
            self._count(ticket, "dispatched")
            future = self._forget(ticket)
            if future is not None and not future.done():
                future.set_result(None)
        for ticket in arrival.shed:
            self._count(ticket, "shed")
            future = self._forget(ticket)
            if future is not None and not future.done():
                future.set_exception(Shed("the queue is full and this request has the lowest priority",
                                          self.retry_after_s))
        self._export()

    def _forget(self, ticket: Ticket) -> asyncio.Future[None] | None:
        self._entered.pop(ticket, None)
        return self._waiters.pop(ticket, None)

    def _count(self, ticket: Ticket, outcome: str) -> None:
        self.metrics.requests.labels(self.metrics.service, self.metrics.label(ticket.tenant), str(ticket.priority),
                                     outcome).inc()

    def _export(self) -> None:
        service = self.metrics.service
        waiting = self.queue.waiting()
        by_label: dict[tuple[str, int], int] = {}
        for (tenant, priority), count in waiting.items():
            key = (self.metrics.label(tenant), priority)
            by_label[key] = by_label.get(key, 0) + count
        for key in self._shown | set(by_label):
            self.metrics.waiting.labels(service, key[0], str(key[1])).set(by_label.get(key, 0))
        self._shown |= set(by_label)
        self.metrics.inflight.labels(service, "inflight").set(self.queue.inflight)
        self.metrics.inflight.labels(service, "capacity").set(self.queue.capacity)


def gate_for(config: PickerConfig, state: PickerState) -> FlowGate | None:
    """The service's gate (None without flow control), sized by the ready replicas and following them. Both of the
    picker's front doors share it: the places are the replicas', however requests come."""
    if config.flow_control is None:
        return None
    gate = FlowGate(config.flow_control, FlowMetrics(state.metrics.service, state.metrics.registry),
                    retry_after_s=config.retry_after_seconds, replicas=len(state.serving()))
    state.on_replicas.append(gate.resize)
    return gate
