"""What the request fuzzer found, pinned at the unit level: JSON nested past the parser's stack is a client error
(it was a 500), and request bodies are bounded in size and in time (they were read whole, however big or slow)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from loom.e2e.chaos.bodies import Probe, problem
from loom.workloads.common.body_limit import BodyLimit
from loom.workloads.router.payload import Payload, PayloadError
from loom.workloads.server.protocol import ProtocolError, decode_generate_request, decode_infer_request

DEEP = b"[" * 100_000 + b"]" * 100_000


def test_deeply_nested_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="nested too deeply") as raised:
        decode_infer_request(DEEP, None)
    assert raised.value.status == 400
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode_generate_request(b'{"text_input": ' + DEEP + b"}")


def test_deeply_nested_json_is_a_payload_error_in_the_router() -> None:
    with pytest.raises(PayloadError, match="nested too deeply"):
        Payload(DEEP).doc()


async def _echo_length(request: Request) -> JSONResponse:
    return JSONResponse({"length": len(await request.body())})


def _client(max_bytes: int = 1024, timeout_s: float = 5.0) -> TestClient:
    app = Starlette(
        routes=[Route("/", _echo_length, methods=["POST", "GET"])],
        middleware=[Middleware(BodyLimit, max_bytes=max_bytes, timeout_s=timeout_s)],
    )
    return TestClient(app)


def test_bodies_up_to_the_limit_reach_the_app_whole() -> None:
    with _client() as client:
        assert client.post("/", content=b"x" * 1024).json() == {"length": 1024}
        assert client.post("/", content=iter([b"a" * 500, b"b" * 500])).json() == {"length": 1000}
        assert client.get("/").json() == {"length": 0}


def test_a_declared_or_streamed_body_over_the_limit_gets_413() -> None:
    with _client() as client:
        declared = client.post("/", content=b"x" * 1025)
        streamed = client.post("/", content=iter([b"a" * 600, b"b" * 600]))
        bad_length = client.post("/", content=b"{}", headers={"content-length": "two"})
    for answer in (declared, streamed):
        assert answer.status_code == 413 and "exceeds the limit" in answer.json()["error"]
        assert answer.headers["connection"] == "close"
    assert bad_length.status_code == 400


def test_a_body_that_does_not_arrive_in_time_gets_408() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not be called")

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)
        return {"type": "http.request", "body": b"late", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"4")]}
    asyncio.run(BodyLimit(app, max_bytes=1024, timeout_s=0.05)(scope, receive, send))
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"]) == {"error": "request body not received within 0.05 s"}


def test_a_body_already_arrived_when_a_held_up_loop_wakes_past_the_deadline_is_read() -> None:
    """The server's own event loop was held past the deadline (here: a blocking call inside the first receive)
    while the body arrived: the client was not slow, so the app gets the body, not a 408."""
    sent: list[dict[str, Any]] = []
    got: list[bytes] = []
    calls = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(0.2)  # the loop is held well past the 0.05 s deadline...
            await asyncio.sleep(0.01)  # ...and the deadline fires at its next wait
        return {"type": "http.request", "body": b"ontime", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"6")]}
    asyncio.run(BodyLimit(app, max_bytes=1024, timeout_s=0.05)(scope, receive, send))
    assert calls == 2 and got == [b"ontime"] and sent[0]["status"] == 200


def test_the_answer_rule() -> None:
    invalid = Probe("malformed-json", "infer", b"{")
    assert problem(invalid, 400, b'{"error": "request body is not valid JSON"}') is None
    assert problem(invalid, 200, b"{}") == "malformed-json: answered 200 to an invalid request"
    assert problem(invalid, 500, b"{}") is not None
    assert problem(invalid, 400, b"not json") is not None
    maybe = Probe("wrong-types-shapes", "infer", b"{}", invalid=False)
    assert problem(maybe, 200, b"{}") is None
