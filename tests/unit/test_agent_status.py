"""Node agent bookkeeping: container states, pod phase and conditions, probes, back-off, endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from loom.devstack.agent.logserver import tail
from loom.devstack.agent.probes import ProbeTracker, resolve_port
from loom.devstack.agent.proxies import (
    PodEndpoint,
    PortProxy,
    ServiceTable,
    headless_endpoints,
    pod_backends,
    ready_endpoints,
)
from loom.devstack.agent.runtime import parse_exit
from loom.devstack.agent.status import ContainerState, PodState, backoff_seconds, pod_status, ran_for_seconds


def _pod(*containers: ContainerState, init: tuple[ContainerState, ...] = ()) -> PodState:
    return PodState("u", "127.10.0.2", "127.0.0.1", "2026-01-01T00:00:00Z", list(init), list(containers))


def test_phase_moves_from_pending_to_running_to_final() -> None:
    web = ContainerState("web", "img", "u")
    pod = _pod(web, init=(ContainerState("setup", "img", "u"),))
    status = pod_status(pod)
    assert status["phase"] == "Pending"
    assert status["containerStatuses"][0]["state"]["waiting"] == {"reason": "ContainerCreating"}
    pod.initialized = True
    web.running("2026-01-01T00:00:01Z", 0)
    web.ready = True
    status = pod_status(pod)
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert status["phase"] == "Running" and conditions == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert status["podIP"] == "127.10.0.2" and status["podIPs"] == [{"ip": "127.10.0.2"}]
    web.terminated(1)
    pod.final_phase = "Failed"
    status = pod_status(pod)
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert status["phase"] == "Failed" and terminated["exitCode"] == 1 and terminated["reason"] == "Error"
    assert {c["type"]: c.get("reason") for c in status["conditions"]}["Ready"] == "PodCompleted"


def test_restart_keeps_last_termination_and_counts() -> None:
    web = ContainerState("web", "img", "u")
    web.running("t0", 0)
    web.terminated(137)
    web.restart_count += 1
    web.waiting("CrashLoopBackOff", "back-off 2s")
    status = web.to_status()
    assert status["restartCount"] == 1 and status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert status["lastState"]["terminated"]["exitCode"] == 137
    web.running("t1", 1)
    assert web.to_status()["containerID"].endswith("/web/1")


def test_transition_time_only_changes_with_the_status() -> None:
    pod = _pod(ContainerState("web", "img", "u"))
    old = [{"type": "Ready", "status": "False", "lastTransitionTime": "long-ago"}]
    kept = {c["type"]: c["lastTransitionTime"] for c in pod_status(pod, old)["conditions"]}
    assert kept["Ready"] == "long-ago"
    old = [{"type": "Ready", "status": "True", "lastTransitionTime": "long-ago"}]
    assert {c["type"]: c["lastTransitionTime"] for c in pod_status(pod, old)["conditions"]}["Ready"] != "long-ago"


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff_seconds(n, 2, 60) for n in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]


def test_probe_thresholds() -> None:
    tracker = ProbeTracker(success_threshold=2, failure_threshold=3)
    assert tracker.record(True) is None and tracker.record(True) is True and tracker.ok is True
    assert tracker.record(False) is None and tracker.record(False) is None
    assert tracker.record(True) is None  # a success resets the failure streak
    assert [tracker.record(False) for _ in range(3)] == [None, None, False]
    assert resolve_port("http", {"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}) == 8080
    assert resolve_port("9000", {"name": "c"}) == 9000


def test_exit_file_and_log_tail() -> None:
    assert parse_exit("0\n") == (0, None)
    assert parse_exit("128 StartError") == (128, "StartError")
    assert tail(b"a\nb\nc\n", 2) == b"b\nc\n" and tail(b"a\nb", 0) == b""


def test_ready_endpoints_skip_unready_and_pick_the_named_port() -> None:
    slices = [
        {
            "ports": [{"name": "http", "port": 8080}, {"name": "metrics", "port": 9090}],
            "endpoints": [
                {"addresses": ["127.10.0.2"], "conditions": {"ready": True}, "hostname": "w-0"},
                {"addresses": ["127.10.0.3"], "conditions": {"ready": False}},
                {"addresses": ["127.10.0.4"], "conditions": {}},
            ],
        }
    ]
    endpoints, port = ready_endpoints(slices, "http")
    assert endpoints == [("127.10.0.2", "w-0"), ("127.10.0.4", None)] and port == 8080
    assert ready_endpoints(slices, "metrics")[1] == 9090


async def test_proxy_spreads_connections_and_skips_dead_backends() -> None:
    async def serve(name: bytes, host: str) -> asyncio.Server:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(name + await reader.readline())
            await writer.drain()
            writer.close()

        return await asyncio.start_server(handle, host, 0)

    first, second = await serve(b"one:", "127.10.250.1"), await serve(b"two:", "127.10.250.2")
    proxy = PortProxy("127.20.250.1", 0)
    await proxy.start()
    assert proxy._server is not None
    port = proxy._server.sockets[0].getsockname()[1]
    backends = [
        ("127.10.250.1", first.sockets[0].getsockname()[1]),
        ("127.10.250.2", second.sockets[0].getsockname()[1]),
    ]

    async def ask() -> bytes:
        reader, writer = await asyncio.open_connection("127.20.250.1", port)
        writer.write(b"hi\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return answer

    proxy.backends = backends
    answers = {await ask() for _ in range(4)}
    assert answers == {b"one:hi\n", b"two:hi\n"}
    second.close()
    await second.wait_closed()
    assert {await ask() for _ in range(4)} == {b"one:hi\n"}
    proxy.backends = []
    with contextlib.suppress(ConnectionResetError):  # no ready endpoint: closed (maybe reset), no answer
        assert await ask() == b""
    first.close()
    await proxy.close()


def test_service_endpoints_come_from_ready_selected_pods() -> None:
    service = {
        "metadata": {"name": "workers", "namespace": "ns"},
        "spec": {"selector": {"app": "w"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    pods = [
        PodEndpoint("ns", {"app": "w"}, "127.10.0.2", True, "w-0", "workers", {"http": 8080}),
        PodEndpoint("ns", {"app": "w", "extra": "x"}, "127.10.0.3", False, "w-1", "workers", {"http": 8080}),
        PodEndpoint("ns", {"app": "w"}, "127.10.0.4", True, None, None, {"http": 9000}),
        PodEndpoint("other", {"app": "w"}, "127.10.0.5", True),
        PodEndpoint("ns", {"app": "v"}, "127.10.0.6", True),
    ]
    port = service["spec"]["ports"][0]
    assert pod_backends(service, port, pods) == [("127.10.0.2", 8080), ("127.10.0.4", 9000)]
    assert pod_backends(service, {"port": 80}, pods) == [("127.10.0.2", 80), ("127.10.0.4", 80)]
    assert headless_endpoints(service, pods) == [("127.10.0.2", "w-0"), ("127.10.0.4", None)]
    service["spec"]["publishNotReadyAddresses"] = True
    assert ("127.10.0.3", "w-1") in headless_endpoints(service, pods)


async def test_service_table_moves_off_an_address_someone_else_holds(tmp_path: Path) -> None:
    service = {
        "metadata": {"name": "api", "namespace": "ns"},
        "spec": {"selector": {"app": "a"}, "ports": [{"port": 18080}]},
    }
    table = ServiceTable(tmp_path)
    await table.sync([service], [], [])
    first = table.entries["ns/api"].address
    await table.close()
    squatter = await asyncio.start_server(lambda r, w: None, first, 18080)
    try:
        other = ServiceTable(tmp_path / "other")
        (tmp_path / "other").mkdir()
        other._addresses = {"ns/api": first}  # as if an earlier run had recorded it
        await other.sync([service], [], [])
        moved = other.entries["ns/api"].address
        assert moved != first and [v.address for v in other.views] == [moved]
        assert json.loads((tmp_path / "other" / "services.json").read_text())["ns/api"]["address"] == moved
        await other.close()
    finally:
        squatter.close()


def test_run_length_for_backoff_reset() -> None:
    assert ran_for_seconds("2026-01-01T00:00:00Z", "2026-01-01T00:10:30Z") == 630
    assert ran_for_seconds(None, "2026-01-01T00:00:00Z") == 0
