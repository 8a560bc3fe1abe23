"""Upstream calls (httpx MockTransport, no sockets), trace headers and the body rewrites of chaining."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from loom.workloads.router.config import UpstreamConfig
from loom.workloads.router.payload import Payload, PayloadError, as_request, error_message
from loom.workloads.router.upstream import UpstreamFailure, Upstreams, child_traceparent, forwarded_headers

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def upstreams(handler: httpx.MockTransport) -> Upstreams:
    return Upstreams({"a": UpstreamConfig(url="http://a.ns.svc", model_name="model-a")}, 5.0, transport=handler)


async def test_call_posts_the_bytes_to_the_model_path_with_framing_headers() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b'{"outputs":[]}', headers={"content-type": "application/json"})

    pool = upstreams(httpx.MockTransport(handle))
    body = b'{"inputs":[{"name":"x","datatype":"UINT8","shape":[2],"parameters":{"binary_data_size":2}}]}\x01\x02'
    header_length = body.index(b"\x01")
    payload = Payload(body, "application/octet-stream", header_length)
    result = await pool.call("a", "infer", payload, forwarded_headers({"x-api-key": "k", "traceparent": TRACEPARENT}))
    await pool.aclose()
    request = seen[0]
    assert str(request.url) == "http://a.ns.svc/v2/models/model-a/infer"
    assert request.content == body
    assert request.headers["inference-header-content-length"] == str(header_length)
    assert request.headers["content-type"] == "application/octet-stream"
    assert request.headers["x-api-key"] == "k"
    assert request.headers["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert (result.origin, result.doc()) == ("response", {"outputs": []})


@pytest.mark.parametrize(
    ("response", "status", "message", "headers"),
    [
        (httpx.Response(500, json={"error": "boom"}), 500, "boom", {}),
        (httpx.Response(503, json={"error": "busy"}, headers={"retry-after": "2"}), 503, "busy", {"retry-after": "2"}),
        (httpx.Response(502, text="<html>bad gateway</html>"), 502, "<html>bad gateway</html>", {}),
        (httpx.Response(500, content=b""), 500, "(empty body)", {}),
    ],
)
async def test_an_error_answer_is_an_upstream_failure_with_its_message(
    response: httpx.Response, status: int, message: str, headers: dict[str, str]
) -> None:
    pool = upstreams(httpx.MockTransport(lambda request: response))
    with pytest.raises(UpstreamFailure) as caught:
        await pool.call("a", "infer", Payload(b"{}"), {})
    assert (caught.value.status, caught.value.message, caught.value.headers) == (status, message, headers)


async def test_a_connection_failure_has_no_status_and_a_timeout_is_a_timeout_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(UpstreamFailure) as caught:
        await upstreams(httpx.MockTransport(refuse)).call("a", "infer", Payload(b"{}"), {})
    assert caught.value.status is None and "ConnectError" in caught.value.message

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=request)

    with pytest.raises(TimeoutError):
        await upstreams(httpx.MockTransport(slow)).call("a", "infer", Payload(b"{}"), {})


class Events(httpx.AsyncByteStream):
    def __init__(self, *chunks: bytes):
        self.chunks = chunks
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


async def test_stream_yields_the_upstream_chunks_as_they_are() -> None:
    events = Events(b'data: {"text_output": "a"}\n\n', b'data: {"text_output": "b"}\n\n')
    pool = upstreams(httpx.MockTransport(lambda request: httpx.Response(200, stream=events)))
    stream = await pool.stream("a", "generate_stream", Payload(b'{"text_input": "x"}'), {})
    assert [chunk async for chunk in stream.chunks()] == list(events.chunks)
    assert events.closed


async def test_an_error_event_before_any_data_is_a_failure_not_a_stream() -> None:
    events = Events(b'data: {"error": "RuntimeError: CUDA error"}\n\n')
    pool = upstreams(httpx.MockTransport(lambda request: httpx.Response(200, stream=events)))
    with pytest.raises(UpstreamFailure) as caught:
        await pool.stream("a", "generate_stream", Payload(b"{}"), {})
    assert (caught.value.status, caught.value.message) == (200, "RuntimeError: CUDA error")
    assert events.closed


async def test_a_refused_stream_is_a_failure_with_the_status() -> None:
    pool = upstreams(httpx.MockTransport(lambda request: httpx.Response(400, json={"error": "no text_input"})))
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
