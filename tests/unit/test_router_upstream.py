"""Upstream calls (against a real aiohttp server on 127.0.0.1), trace headers and the body rewrites of chaining."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import test_utils, web

from loom.workloads.router.config import UpstreamConfig
from loom.workloads.router.payload import Payload, PayloadError, as_request, error_message
from loom.workloads.router.upstream import UpstreamFailure, Upstreams, child_traceparent, forwarded_headers

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def model(handler: Handler, timeout_s: float = 5.0, max_connections: int = 100) -> AsyncIterator[Upstreams]:
    """A real HTTP server on 127.0.0.1 answering every model path with ``handler``, and the pools to it."""
    app = web.Application()
    app.router.add_post("/v2/models/{model}/{endpoint}", handler)
    async with test_utils.TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        pool = Upstreams({"a": UpstreamConfig(url=url, model_name="model-a")}, timeout_s, max_connections)
        try:
            yield pool
        finally:
            await pool.aclose()


def answer(status: int, body: bytes, headers: dict[str, str] | None = None) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, body=body, headers=headers)

    return handle


async def test_call_posts_the_bytes_to_the_model_path_with_framing_headers() -> None:
    seen: list[tuple[web.Request, bytes]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append((request, await request.read()))
        return web.Response(body=b'{"outputs":[]}', headers={"content-type": "application/json"})

    body = b'{"inputs":[{"name":"x","datatype":"UINT8","shape":[2],"parameters":{"binary_data_size":2}}]}\x01\x02'
    header_length = body.index(b"\x01")
    payload = Payload(body, "application/octet-stream", header_length)
    async with model(handle) as pool:
        headers = forwarded_headers({"x-api-key": "k", "traceparent": TRACEPARENT})
        result = await pool.call("a", "infer", payload, headers)
    request, received = seen[0]
    assert (request.method, request.path, request.version) == ("POST", "/v2/models/model-a/infer", (1, 1))
    assert received == body
    assert request.headers["inference-header-content-length"] == str(header_length)
    assert request.headers["content-type"] == "application/octet-stream"
    assert request.headers["x-api-key"] == "k"
    assert request.headers["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert request.headers["traceparent"] != TRACEPARENT  # the step is a child span
    assert (result.origin, result.doc()) == ("response", {"outputs": []})


async def test_calls_reuse_one_keep_alive_connection_and_keep_no_cookies() -> None:
    peers: list[object] = []
    cookies: list[str | None] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        cookies.append(request.headers.get("cookie"))
        return web.Response(body=b'{"outputs":[]}', headers={"set-cookie": "session=other-caller"})

    async with model(handle) as pool:
        for _ in range(3):
            await pool.call("a", "infer", Payload(b"{}"), {})
    assert peers[0] is not None and peers == [peers[0]] * 3
    assert cookies == [None, None, None]


@pytest.mark.parametrize(
    ("status", "body", "extra", "message", "headers"),
    [
        (500, b'{"error": "boom"}', {}, "boom", {}),
        (503, b'{"error": "busy"}', {"retry-after": "2"}, "busy", {"retry-after": "2"}),
        (502, b"<html>bad gateway</html>", {}, "<html>bad gateway</html>", {}),
        (500, b"", {}, "(empty body)", {}),
    ],
)
async def test_an_error_answer_is_an_upstream_failure_with_its_message(
    status: int, body: bytes, extra: dict[str, str], message: str, headers: dict[str, str]
) -> None:
    async with model(answer(status, body, extra)) as pool:
        with pytest.raises(UpstreamFailure) as caught:
            await pool.call("a", "infer", Payload(b"{}"), {})
    assert (caught.value.status, caught.value.message, caught.value.headers) == (status, message, headers)


async def test_a_connection_failure_has_no_status_and_a_timeout_is_a_timeout_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        pool = Upstreams({"a": UpstreamConfig(url=f"http://127.0.0.1:{port}", model_name="m")}, 5.0)
        with pytest.raises(UpstreamFailure) as caught:
            await pool.call("a", "infer", Payload(b"{}"), {})
        await pool.aclose()
    assert caught.value.status is None
    assert caught.value.message.startswith("cannot reach a: ClientConnectorError")

    async def never(request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with model(never, timeout_s=0.2) as pool:
        with pytest.raises(TimeoutError):
            await pool.call("a", "infer", Payload(b"{}"), {})


EVENTS = (b'data: {"text_output": "a"}\n\n', b'data: {"text_output": "b"}\n\n')


async def test_stream_returns_at_the_first_event_and_passes_the_rest_on_as_it_comes() -> None:
    more = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENTS[0])
        await more.wait()  # the second event exists only once the router has answered with the first
        await response.write(EVENTS[1])
        await response.write_eof()
        return response

    async with model(handle, timeout_s=10.0, max_connections=1) as pool:
        stream = await pool.stream("a", "generate_stream", Payload(b'{"text_input": "x"}'), {})
        assert stream.first == EVENTS[0]
        more.set()
        assert b"".join([chunk async for chunk in stream.chunks()]) == b"".join(EVENTS)
        # The connection went back to the pool of one: the next step gets it.
        more.clear()
        again = await pool.stream("a", "generate_stream", Payload(b"{}"), {})
        more.set()
        assert b"".join([chunk async for chunk in again.chunks()]) == b"".join(EVENTS)


async def test_an_error_event_before_any_data_is_a_failure_not_a_stream() -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        if (await request.read()) == b"ok":
            return web.Response(body=b'{"outputs":[]}')
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"error": "RuntimeError: CUDA error"}\n\n')
        await asyncio.Event().wait()  # a server that keeps the stream open after its error event
        raise AssertionError("unreachable")

    # A bound only for a regression (a stream that never ends); wide, so a loaded machine (the unit tier runs beside
    # the cluster tiers) cannot time out the connect: make test once saw 2 s pass before localhost answered.
    async with model(handle, timeout_s=10.0, max_connections=1) as pool:
        with pytest.raises(UpstreamFailure) as caught:
            await pool.stream("a", "generate_stream", Payload(b"{}"), {})
        assert (caught.value.status, caught.value.message) == (200, "RuntimeError: CUDA error")
        # The failed stream's connection was given up: the pool of one still serves.
        assert (await pool.call("a", "infer", Payload(b"ok"), {})).doc() == {"outputs": []}


async def test_a_refused_stream_is_a_failure_with_the_status() -> None:
    async with model(answer(400, b'{"error": "no text_input"}')) as pool:
        with pytest.raises(UpstreamFailure) as caught:
            await pool.stream("a", "generate_stream", Payload(b"{}"), {})
    assert (caught.value.status, caught.value.message) == (400, "no text_input")


def test_child_traceparent_keeps_trace_and_flags_with_a_new_span() -> None:
    version, trace, span, flags = child_traceparent(TRACEPARENT).split("-")
    assert (version, trace, flags) == ("00", "4bf92f3577b34da6a3ce929d0e0e4736", "01")
    assert len(span) == 16 and span != "00f067aa0ba902b7"


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    ],
)
def test_an_invalid_caller_trace_starts_a_new_one(bad: str) -> None:
    headers = forwarded_headers({"traceparent": bad, "authorization": "Bearer k", "cookie": "secret"})
    version, trace, span, flags = headers["traceparent"].split("-")
    assert (version, flags, len(trace), len(span)) == ("00", "00", 32, 16)
    assert trace not in bad
    assert headers["authorization"] == "Bearer k"
    assert "cookie" not in headers  # only the listed headers travel to the steps


def test_chaining_turns_outputs_into_inputs_and_keeps_binary_tails() -> None:
    doc = {"model_name": "m", "id": "r", "parameters": {"p": 1},
           "outputs": [{"name": "y", "datatype": "UINT8", "shape": [2], "parameters": {"binary_data_size": 2}}]}
    head = json.dumps(doc).encode()
    response = Payload(head + b"\x05\x06", "application/octet-stream", len(head), "response")
    chained = as_request(response, "infer", Payload(b"{}"))
    assert chained.origin == "request"
    assert chained.doc() == {"inputs": doc["outputs"], "id": "r", "parameters": {"p": 1}}
    assert chained.tail == b"\x05\x06"
    assert chained.http_headers()["inference-header-content-length"] == str(chained.header_length)


def test_chaining_leaves_other_shapes_and_requests_alone() -> None:
    request = Payload(b'{"inputs": []}')
    assert as_request(request, "infer", request) is request
    custom = Payload(b'{"predictions": [1]}', origin="response")
    assert as_request(custom, "infer", request) is custom
    text = Payload(b'{"text_output": "hi", "id": "r"}', origin="response")
    graph_request = Payload(b'{"text_input": "x", "parameters": {"temperature": 0}}')
    assert as_request(text, "generate", graph_request).doc() == {
        "text_input": "hi", "parameters": {"temperature": 0}, "id": "r"}


def test_error_bodies_are_recognised_and_data_mentioning_error_is_not() -> None:
    assert error_message(Payload(b'{"error": "bad"}')) == "bad"
    assert error_message(Payload(b'{"error": {"detail": 1}}')) == '{"detail": 1}'
    assert error_message(Payload(b'{"outputs": [{"name": "error", "data": ["x"]}]}')) is None
    assert error_message(Payload(b'{"outputs": []}')) is None


def test_framing_headers_are_checked() -> None:
    with pytest.raises(PayloadError, match="exceeds"):
        Payload.from_http(b"{}", {"inference-header-content-length": "10"}, "request")
    with pytest.raises(PayloadError, match="integer"):
        Payload.from_http(b"{}", {"inference-header-content-length": "x"}, "request")
    with pytest.raises(PayloadError, match="not valid JSON"):
        Payload(b"{oops").doc()
