"""GIE's endpoint-picker protocol over Envoy's ext_proc: one gRPC stream per HTTP request, answered with the same
decision the picker's own proxy takes (decide.py). The protocol as GIE's proposal 004 defines it:

- Request side. Envoy sends the request's headers, then its body (buffered whole, or streamed in chunks when the
  filter runs FULL_DUPLEX_STREAMED, as GIE's gateways configure it); the picker decides once the body is complete
  (a request without a body: at its headers) and names the replica twice, with identical values: the request header
  `x-gateway-destination-endpoint` and the dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`, each
  `ip:port` of the chosen replica followed by its fallbacks, comma-separated.
- The subset hint: when Envoy passes filter metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`
  (a list of `ip:port`), only those replicas may be chosen; none of them ready is a 503.
- Refusals are immediate responses: 503 when no replica is ready (at once: the gateway holds nothing for the
  picker), 429 when the picker sheds the request (flow control), each with the picker's JSON error body.
- Response side. The endpoint that served (Envoy's metadata `envoy.lb` / `x-gateway-destination-endpoint-served`,
  or the response header of that name a gateway adds) is where the picker counts the request from then on, and the
  response carries it as the header `x-gateway-destination-endpoint-served`.

Which body mode runs: Envoy announces it in the stream's first message (protocol_config); an Envoy too old to say
is taken as BUFFERED. In BUFFERED (and BUFFERED_PARTIAL) mode the headers are answered at once (held by Envoy until
the body is answered, so the header set in the body's answer still routes); in FULL_DUPLEX_STREAMED nothing is
answered until the body is complete, then the headers' answer carries the decision and the body goes back whole
(in chunks) as streamed body mutations. STREAMED mode sends the headers upstream before any body: the decision is
taken at the headers, from the path and headers alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import struct_pb2

from . import protocol as pb
from .decide import Decider, Outcome, PickRequest, Refused, Routed

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# A body goes back to Envoy in chunks of at most this (gRPC's default message limit is 4 MiB).
BODY_CHUNK = 64 * 1024

BUFFERED = pb.BODY_MODES["BUFFERED"]
FULL_DUPLEX = pb.BODY_MODES["FULL_DUPLEX_STREAMED"]
STREAMED = pb.BODY_MODES["STREAMED"]
NONE = pb.BODY_MODES["NONE"]


# ------------------------------------------------------------------------------------------- reading Envoy's messages


def header_map(headers: Any) -> dict[str, str]:
    """Header names (lower case, as Envoy sends them) -> value; Envoy fills raw_value, older ones value."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _metadata_value(request: Any, namespace: str, key: str) -> Any:
    meta = request.metadata_context.filter_metadata
    if namespace not in meta or key not in meta[namespace].fields:
        return None
    value = meta[namespace].fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return value.string_value
    return None


def subset_hint(request: Any) -> frozenset[str] | None:
    """The endpoints the gateway limits this request to (None: no hint). A comma-separated string is read too."""
    value = _metadata_value(request, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    items = value if isinstance(value, list) else value.split(",")
    return frozenset(e.strip() for e in items if e.strip())


def served_endpoint(request: Any, headers: Mapping[str, str]) -> str | None:
    """The endpoint that served the request: Envoy's metadata first (the protocol's), else the response header."""
    value = _metadata_value(request, LB_NAMESPACE, SERVED)
    if isinstance(value, str) and value:
        return value.split(",")[0].strip()
    header = headers.get(SERVED, "")
    return header.split(",")[0].strip() or None


# ------------------------------------------------------------------------------------------- the picker's answers


def _set(name: str, value: str) -> Any:
    return pb.HeaderValueOption(header=pb.HeaderValue(key=name, raw_value=value.encode()),
                                append_action=pb.OVERWRITE_IF_EXISTS_OR_ADD)


def destination_metadata(endpoints: Sequence[str]) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}})
    return meta


def routed_common(routed: Routed, body_length: int | None) -> Any:
    """The header that routes (the same value as the metadata beside it); the body's length when Envoy forwards a
    body the picker sent back (full duplex), as GIE's picker sets it."""
    headers = [_set(DESTINATION, ",".join(routed.endpoints))]
    if body_length is not None:
        headers.append(_set("content-length", str(body_length)))
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)


def refusal(refused: Refused) -> Any:
    """An immediate response: 503 or 429 with the picker's JSON error, Retry-After when known."""
    headers = [_set("content-type", "application/json")]
    if refused.retry_after_s is not None:
        headers.append(_set("retry-after", str(refused.retry_after_s)))
    body = json.dumps({"error": refused.message, "code": refused.code}).encode()
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=refused.status),
        headers=pb.HeaderMutation(set_headers=headers), body=body, details=refused.code))


def _body_answer(mutation: Any, *, request: bool) -> Any:
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    return pb.ProcessingResponse(request_body=answer) if request else pb.ProcessingResponse(response_body=answer)


def echo(chunk: Any, *, request: bool) -> Any:
    """A chunk passed on unchanged (full duplex, once decided)."""
    return _body_answer(pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
        body=chunk.body, end_of_stream=chunk.end_of_stream)), request=request)


def streamed_body(body: bytes, *, request: bool) -> list[Any]:
    """`body` sent back as streamed mutations (full duplex: Envoy forwards only what the picker returns)."""
    chunks = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    return [_body_answer(pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
        body=chunk, end_of_stream=i == len(chunks) - 1)), request=request) for i, chunk in enumerate(chunks)]


# ------------------------------------------------------------------------------------------- one stream


@dataclass
class ExtProcStream:
    """One HTTP request's ext_proc stream: feed it Envoy's messages in order (`handle`), send back what each
    returns, and call `close` when the stream ends, however it ends."""

    decider: Decider
    request_mode: int = BUFFERED
    response_mode: int = NONE
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    routed: Routed | None = None
    served: str | None = None
    closed: bool = False

    async def handle(self, request: Any) -> list[Any]:
        if request.HasField("protocol_config"):
            self.request_mode = request.protocol_config.request_body_mode
            self.response_mode = request.protocol_config.response_body_mode
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(request)
        if kind == "request_body":
            return await self._request_body(request.request_body)
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            return self._response_body(request.response_body)
        if kind == "response_trailers":
            self.close()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def _decide(self) -> Outcome:
        outcome = await self.decider.decide(PickRequest(
            self.headers.get(":path", "/").split("?")[0], bytes(self.body), self.headers, subset=self.subset))
        if isinstance(outcome, Routed):
            self.routed = outcome
        return outcome

    async def _request_headers(self, request: Any) -> list[Any]:
        self.headers = header_map(request.request_headers)
        self.subset = subset_hint(request)
        if not (request.request_headers.end_of_stream or self.request_mode in (STREAMED, NONE)):
            # The decision waits for the body. Buffered: Envoy holds the headers until the body is answered.
            return [] if self.request_mode == FULL_DUPLEX else [
                pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        outcome = await self._decide()
        if isinstance(outcome, Refused):
            return [refusal(outcome)]
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=routed_common(outcome, None)),
                                      dynamic_metadata=destination_metadata(outcome.endpoints))]

    async def _request_body(self, chunk: Any) -> list[Any]:
        self.body += chunk.body
        done = chunk.end_of_stream or chunk.end_of_stream_without_message
        if self.routed is not None:  # decided at the headers (STREAMED): pass the body on
            return ([echo(chunk, request=True)] if self.request_mode == FULL_DUPLEX
                    else [pb.ProcessingResponse(request_body=pb.BodyResponse())])
        if not done:
            # Full duplex: keep the chunk (Envoy forwards only what comes back); partial buffering: continue.
            return [] if self.request_mode == FULL_DUPLEX else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        outcome = await self._decide()
        if isinstance(outcome, Refused):
            return [refusal(outcome)]
        metadata = destination_metadata(outcome.endpoints)
        if self.request_mode == FULL_DUPLEX:
            return [pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=routed_common(outcome, len(self.body))),
                dynamic_metadata=metadata), *streamed_body(bytes(self.body), request=True)]
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed_common(outcome, None)),
                                      dynamic_metadata=metadata)]

    def _response_headers(self, request: Any) -> list[Any]:
        served = served_endpoint(request, header_map(request.response_headers))
        if self.routed is not None:
            served = served or self.routed.endpoint
            if self.served is None:
                self.decider.served(self.routed, served)
                self.served = served
        mutation = pb.HeaderMutation(set_headers=[_set(SERVED, served)]) if served else None
        answer = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation)))
        if request.response_headers.end_of_stream:
            self.close()
        return [answer]

    def _response_body(self, chunk: Any) -> list[Any]:
        if chunk.end_of_stream or chunk.end_of_stream_without_message:
            self.close()
        if self.response_mode == FULL_DUPLEX:
            return [echo(chunk, request=False)]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def close(self) -> None:
        """The request is over: its place in flight is freed (once)."""
        if self.closed:
            return
        self.closed = True
        if self.routed is not None:
            self.decider.finished(self.routed, self.served)
