"""Draining through the node agent's Service proxies: a terminating pod gets no new connections (unless no
other endpoint is ready, as kube-proxy's terminating-endpoint fallback), and connections already piped to
it run to their end."""

from __future__ import annotations

import asyncio

from loom.devstack.agent.proxies import (
    PodEndpoint,
    PortProxy,
    api_endpoints,
    pod_backends,
    ready_endpoints,
    service_backends,
)

SERVICE = {"metadata": {"name": "echo", "namespace": "ns"}, "spec": {"selector": {"app": "e"}}}
PORT = {"port": 80, "targetPort": 8080}


def _endpoint(ip: str, ready: bool, serving: bool | None = None, terminating: bool = False) -> PodEndpoint:
    return PodEndpoint("ns", {"app": "e"}, ip, ready, serving=serving, terminating=terminating)


def test_terminating_pods_are_endpoints_only_while_no_other_is_ready() -> None:
    staying = _endpoint("127.10.0.2", True, True)
    leaving = _endpoint("127.10.0.3", False, True, terminating=True)
    signalled = _endpoint("127.10.0.4", False, False, terminating=True)  # SIGTERM sent: not serving any more
    assert pod_backends(SERVICE, PORT, [staying, leaving, signalled]) == [("127.10.0.2", 8080)]
    assert pod_backends(SERVICE, PORT, [leaving, signalled]) == [("127.10.0.3", 8080)]
    assert pod_backends(SERVICE, PORT, [signalled, _endpoint("127.10.0.5", False)]) == []


def test_a_service_reaches_pods_of_the_real_node_through_its_endpoint_slices() -> None:
    """The agent's own pods (loopback addresses no EndpointSlice can hold) and the pods the slices list (the real
    node's, on its bridge) are backends alike: the API server's webhook calls through the agent reach a pod there."""
    slices = [
        {
            "ports": [{"name": "", "port": 8080}],
            "endpoints": [{"addresses": ["198.18.0.7"], "conditions": {"ready": True}}],
        }
    ]
    here = [_endpoint("127.10.0.2", True)]
    assert service_backends(SERVICE, PORT, slices, here) == [("127.10.0.2", 8080), ("198.18.0.7", 8080)]
    assert service_backends(SERVICE, PORT, slices, []) == [("198.18.0.7", 8080)]
    assert service_backends(SERVICE, PORT, [], here) == [("127.10.0.2", 8080)]
    # Kwok's pods are in the slices too, at addresses nothing answers on: never a backend.
    slices[0]["endpoints"].append({"addresses": ["10.0.0.5"], "conditions": {"ready": True}})
    assert service_backends(SERVICE, PORT, slices, here) == [("127.10.0.2", 8080), ("198.18.0.7", 8080)]
    # Without a selector the slices are hand-written: every endpoint counts, whatever runs here.
    selectorless = {"metadata": SERVICE["metadata"], "spec": {}}
    assert service_backends(selectorless, PORT, slices, here) == [("10.0.0.5", 8080), ("198.18.0.7", 8080)]


def test_endpoint_slices_fall_back_to_serving_terminating_endpoints() -> None:
    def slices(*endpoints: tuple[str, dict[str, bool]]) -> list[dict[str, object]]:
        return [
            {
                "ports": [{"name": "http", "port": 8080}],
                "endpoints": [{"addresses": [ip], "conditions": conditions} for ip, conditions in endpoints],
            }
        ]

    leaving = ("127.10.0.3", {"ready": False, "serving": True, "terminating": True})
    gone = ("127.10.0.4", {"ready": False, "serving": False, "terminating": True})
    assert ready_endpoints(slices(("127.10.0.2", {"ready": True}), leaving, gone), "http")[0] == [("127.10.0.2", None)]
    assert ready_endpoints(slices(leaving, gone), "http")[0] == [("127.10.0.3", None)]
    assert ready_endpoints(slices(gone), "http")[0] == []


def test_pods_the_api_shows_deleted_are_terminating_endpoints() -> None:
    """Before this agent runs the pods itself (a hand-over) it goes by the API: a deleted pod still Ready serves
    only as the fallback."""
    ready = {"conditions": [{"type": "Ready", "status": "True"}], "podIP": "127.10.0.3"}
    pod = {
        "metadata": {"namespace": "ns", "labels": {"app": "e"}, "deletionTimestamp": "x"},
        "spec": {},
        "status": ready,
    }
    (endpoint,) = api_endpoints([pod])
    assert (endpoint.ready, endpoint.serving, endpoint.terminating) == (False, True, True)
    assert pod_backends(SERVICE, PORT, [endpoint, _endpoint("127.10.0.2", True)]) == [("127.10.0.2", 8080)]


async def test_a_connection_in_flight_finishes_after_its_backend_left_the_service() -> None:
    release = asyncio.Event()

    async def serve(name: bytes, host: str, wait: bool) -> asyncio.Server:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await reader.readline()
            writer.write(name + b" got " + request)
            await writer.drain()
            if wait:
                await release.wait()
            writer.write(name + b" done\n")
            await writer.drain()
            writer.close()

        return await asyncio.start_server(handle, host, 0)

    leaving = await serve(b"leaving", "127.10.251.1", wait=True)
    staying = await serve(b"staying", "127.10.251.2", wait=False)
    proxy = PortProxy("127.20.251.1", 0)
    await proxy.start()
    assert proxy._server is not None
    port = proxy._server.sockets[0].getsockname()[1]
    proxy.backends = [("127.10.251.1", leaving.sockets[0].getsockname()[1])]

    async def connect(line: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.20.251.1", port)
        writer.write(line)
        await writer.drain()
        return reader, writer

    slow_reader, slow_writer = await connect(b"slow\n")
    assert await slow_reader.readline() == b"leaving got slow\n"  # in flight on the pod being removed
    proxy.backends = [("127.10.251.2", staying.sockets[0].getsockname()[1])]  # the next sync: it left
    for _ in range(3):
        reader, writer = await connect(b"new\n")
        assert await reader.read() == b"staying got new\nstaying done\n"
        writer.close()
    release.set()
    assert await slow_reader.read() == b"leaving done\n"
    slow_writer.close()
    for server in (leaving, staying):
        server.close()
    await proxy.close()
