"""GIE's endpoint-picker protocol on the picker's side (extproc.py, protocol.py, grpc_server.py), message by message
as Envoy sends them, over the picker's real state and decision: the routing header and the envoy.lb metadata agree,
buffered and full-duplex bodies, the subset hint, 503 and 429 as immediate responses, the served endpoint on the
response path, health by service name. Through a real Envoy: tests/integration/test_picker_envoy.py."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from loom.workloads.picker import protocol as pb
from loom.workloads.picker.config import PickerConfig
from loom.workloads.picker.decide import Decider, Refused
from loom.workloads.picker.extproc import BUFFERED, FULL_DUPLEX, ExtProcStream, refusal
from loom.workloads.picker.grpc_server import health_status
from loom.workloads.picker.metrics import PickerMetrics
from loom.workloads.picker.state import PickerState, Pod

ENDPOINTS = ("10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080")
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a long shared prompt " * 40}]}).encode()


def decider(*endpoints: str, fallbacks: int = 0) -> Decider:
    config = PickerConfig.model_validate({"namespace": "ml", "service": "chat", "pod_selector": {"app": "chat"}})
    state = PickerState(config, PickerMetrics("ml/chat"), draw=lambda: 0.5)
    state.set_replicas({e: Pod(f"r{i}", "stable") for i, e in enumerate(endpoints)})
    return Decider(state, fallbacks=fallbacks)


def headers(end_of_stream: bool = False, mode: int | None = None, subset: list[str] | None = None) -> Any:
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                                      pb.HeaderValue(key=":method", raw_value=b"POST")]),
        end_of_stream=end_of_stream))
    if mode is not None:
        message.protocol_config.request_body_mode = mode
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset})
    return message


def body(data: bytes, end: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def set_headers(mutation: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def destination(answer: Any) -> str:
    return str(json_format.MessageToDict(answer.dynamic_metadata)["envoy.lb"]["x-gateway-destination-endpoint"])


async def test_buffered_the_decision_rides_on_the_body_answer_header_and_metadata_alike() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS))
    [first] = await stream.handle(headers(mode=BUFFERED))
    assert first.WhichOneof("response") == "request_headers" and not first.HasField("dynamic_metadata")
    [answer] = await stream.handle(body(BODY, end=True))
    assert answer.WhichOneof("response") == "request_body"
    routed = set_headers(answer.request_body.response.header_mutation)["x-gateway-destination-endpoint"]
    assert routed in ENDPOINTS and destination(answer) == routed
    assert answer.request_body.response.clear_route_cache
    assert stream.decider.state.inflight[routed] == 1
    stream.close()
    stream.close()  # once only
    assert not stream.decider.state.inflight


async def test_full_duplex_holds_everything_until_the_body_ends_then_sends_it_back_whole() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS))
    assert await stream.handle(headers(mode=FULL_DUPLEX)) == []
    assert await stream.handle(body(BODY[:100], end=False)) == []
    first, *rest = await stream.handle(body(BODY[100:], end=True))
    assert first.WhichOneof("response") == "request_headers"
    mutation = set_headers(first.request_headers.response.header_mutation)
    assert mutation["content-length"] == str(len(BODY))
    assert mutation["x-gateway-destination-endpoint"] == destination(first)
    sent = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in rest)
    assert sent == BODY and rest[-1].request_body.response.body_mutation.streamed_response.end_of_stream


async def test_fallbacks_are_a_comma_separated_list_in_both_places() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS, fallbacks=2))
    await stream.handle(headers(mode=BUFFERED))
    [answer] = await stream.handle(body(BODY, end=True))
    listed = set_headers(answer.request_body.response.header_mutation)["x-gateway-destination-endpoint"]
    assert listed == destination(answer) and sorted(listed.split(",")) == sorted(ENDPOINTS)


async def test_a_request_without_body_is_decided_at_its_headers() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS))
    [answer] = await stream.handle(headers(end_of_stream=True))
    assert destination(answer) in ENDPOINTS
    assert set_headers(answer.request_headers.response.header_mutation)["x-gateway-destination-endpoint"] == (
        destination(answer))


async def test_the_subset_hint_is_obeyed_and_an_empty_one_is_a_503() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS))
    await stream.handle(headers(mode=BUFFERED, subset=[ENDPOINTS[1]]))
    [answer] = await stream.handle(body(BODY, end=True))
    assert destination(answer) == ENDPOINTS[1]
    stream = ExtProcStream(decider(*ENDPOINTS))
    await stream.handle(headers(mode=BUFFERED, subset=["10.9.9.9:8080"]))
    [refused] = await stream.handle(body(BODY, end=True))
    assert refused.immediate_response.status.code == 503


async def test_nothing_ready_is_an_immediate_503_with_the_pickers_error() -> None:
    stream = ExtProcStream(decider())
    await stream.handle(headers(mode=FULL_DUPLEX))
    [answer] = await stream.handle(body(BODY, end=True))
    immediate = answer.immediate_response
    assert immediate.status.code == 503 and json.loads(immediate.body)["code"] == "picker_no_replica"
    assert set_headers(immediate.headers)["retry-after"] == "1"


def test_a_shed_request_is_an_immediate_429_with_retry_after() -> None:
    immediate = refusal(Refused(429, "picker_shed", "saturated", retry_after_s=7)).immediate_response
    assert immediate.status.code == 429 and set_headers(immediate.headers)["retry-after"] == "7"
    assert immediate.details == "picker_shed"


async def test_the_served_endpoint_moves_the_count_and_is_on_the_response() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS, fallbacks=1))
    await stream.handle(headers(mode=BUFFERED))
    [answer] = await stream.handle(body(BODY, end=True))
    first, fallback = destination(answer).split(",")
    response = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=pb.HeaderMap(
        headers=[pb.HeaderValue(key=":status", raw_value=b"200")])))
    response.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": fallback})
    [reply] = await stream.handle(response)
    assert set_headers(reply.response_headers.response.header_mutation) == {
        "x-gateway-destination-endpoint-served": fallback}
    assert dict(stream.decider.state.inflight) == {fallback: 1}
    stream.close()
    assert not stream.decider.state.inflight and first != fallback


async def test_the_served_header_a_gateway_adds_is_read_too() -> None:
    stream = ExtProcStream(decider(*ENDPOINTS))
    await stream.handle(headers(mode=BUFFERED))
    [answer] = await stream.handle(body(BODY, end=True))
    response = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key="x-gateway-destination-endpoint-served", raw_value=destination(answer).encode())])))
    await stream.handle(response)
    assert stream.served == destination(answer)


def test_health_by_service_name_and_a_standby_is_not_serving() -> None:
    serving, not_serving, unknown = 1, 2, 3
    assert health_status("liveness", synced=False, active=False) == serving
    for service in ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension"):
        assert health_status(service, synced=True, active=True) == serving
        assert health_status(service, synced=True, active=False) == not_serving  # a standby replica
        assert health_status(service, synced=False, active=True) == not_serving  # pods not listed yet
    assert health_status("other", synced=True, active=True) == unknown
