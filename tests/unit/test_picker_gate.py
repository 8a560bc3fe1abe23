"""Flow control's edge (workloads/picker/gate.py) on a real event loop: requests wait for a place, tenants take
turns, 429s for the shed and the expired with their Retry-After, a client gone while waiting leaves the queue, and
the metrics per tenant and priority."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from loom.workloads.picker.config import FlowControlConfig
from loom.workloads.picker.flow import Ticket
from loom.workloads.picker.gate import FlowGate, FlowMetrics, Shed


def gate(**fields: object) -> FlowGate:
    config = FlowControlConfig.model_validate({"max_inflight_per_replica": 1, **fields})
    return FlowGate(config, FlowMetrics("ns/svc", CollectorRegistry()), retry_after_s=3, replicas=1)


def key(tenant: str, priority: int | None = None) -> dict[str, str]:
    headers = {"x-tenant": tenant}
    if priority is not None:
        headers["x-loom-priority"] = str(priority)
    return headers


def sample(g: FlowGate, name: str, **labels: str) -> float | None:
    return g.metrics.registry.get_sample_value(name, {"service": "ns/svc", **labels})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_requests_wait_for_a_place_and_tenants_take_turns() -> None:
    g = gate(tenant_header="x-tenant")
    first = await g.enter(key("flood"))
    served: list[str] = []

    async def request(tenant: str) -> None:
        ticket = await g.enter(key(tenant))
        served.append(tenant)
        await asyncio.sleep(0)
        g.leave(ticket)

    tasks = [asyncio.create_task(request("flood")) for _ in range(4)]
    await settle()
    tasks += [asyncio.create_task(request("quiet")) for _ in range(2)]
    await settle()
    assert served == [] and len(g.queue) == 6
    g.leave(first)
    await asyncio.gather(*tasks)
    assert served == ["flood", "quiet", "flood", "quiet", "flood", "flood"]
    assert g.queue.inflight == 0
    g.queue.check()
    assert sample(g, "loom_picker_flow_requests_total", tenant="quiet", priority="0",
                        outcome="dispatched") == 2


async def test_a_full_queue_answers_the_lowest_priority_with_shed() -> None:
    g = gate(tenant_header="x-tenant", max_queued=1, default_priority=5)
    held = await g.enter(key("a"))
    low = asyncio.create_task(g.enter(key("a", priority=0)))
    await settle()
    high = asyncio.create_task(g.enter(key("b")))
    await settle()
    with pytest.raises(Shed) as shed:
        await low
    assert shed.value.retry_after_s == 3
    g.leave(held)
    g.leave(await high)
    assert sample(g, "loom_picker_flow_requests_total", tenant="a", priority="0", outcome="shed") == 1
    g.queue.check()


async def test_a_request_that_waits_past_the_bound_is_expired() -> None:
    g = gate(max_queue_wait_seconds=0.01)
    held = await g.enter({})
    with pytest.raises(Shed, match="waited"):
        await g.enter({})
    assert len(g.queue) == 0
    g.leave(held)
    assert g.queue.inflight == 0
    g.queue.check()


async def test_a_client_gone_while_waiting_leaves_the_queue() -> None:
    g = gate()
    held = await g.enter({})
    waiting = asyncio.create_task(g.enter({}))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(g.queue) == 0 and g.queue.withdrawn == 1
    g.leave(held)
    assert g.queue.inflight == 0


async def test_more_replicas_more_places() -> None:
    g = gate()
    held = await g.enter({})
    waiting = asyncio.create_task(g.enter({}))
    await settle()
    assert not waiting.done()
    g.resize(2)
    ticket: Ticket = await waiting
    g.leave(ticket)
    g.leave(held)
    assert sample(g, "loom_picker_flow_inflight", kind="capacity") == 2


async def test_no_replica_counts_as_one_place_so_the_picker_answers_503_itself() -> None:
    g = gate(max_inflight_per_replica=2)
    g.resize(0)
    assert g.queue.capacity == 2


async def test_tenant_priorities_cap_what_a_request_asks() -> None:
    g = gate(tenant_header="x-tenant", tenant_priorities={"gold": 10}, default_priority=0)
    assert g.classify(key("gold")) == ("gold", 10)
    assert g.classify(key("gold", priority=50)) == ("gold", 10)
    assert g.classify(key("free", priority=50)) == ("free", 0)
    assert g.classify(key("free", priority=-5)) == ("free", -5)
