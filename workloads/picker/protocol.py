"""The part of Envoy's ext_proc API (envoy.service.ext_proc.v3) that the endpoint-picker protocol uses, as protobuf
message classes built at import time from the field table below: no generated code, no package of Envoy's protos.

Why not a package of generated Envoy protos: the maintained one ships a top-level `cel` package that overwrites the
CEL binding Loom validates with (common-expression-language's `cel`). Protobuf's wire format carries field numbers
and types, not names, so these messages (same numbers and types as Envoy's, a subset of its fields; anything else
Envoy sends is kept as unknown fields and ignored) read and write what Envoy does. The one name that must match is
the service's, which is the gRPC path: /envoy.service.ext_proc.v3.ExternalProcessor/Process. The messages live
under that package in protobuf's default pool (Envoy's own classes are never loaded beside them in the picker).

Field numbers: envoy/service/ext_proc/v3/external_processor.proto, envoy/config/core/v3/base.proto,
envoy/type/v3/http_status.proto, envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

PACKAGE = "envoy.service.ext_proc.v3"
SERVICE = f"{PACKAGE}.ExternalProcessor"
PROCESS = f"/{SERVICE}/Process"
FILE = "loom/picker/envoy_ext_proc_subset.proto"

F = descriptor_pb2.FieldDescriptorProto
# (number, name, type, repeated, message/enum type name (local, or a full name with a dot first), oneof)
Field = tuple[int, str, int, bool, str | None, str | None]
MESSAGE, BYTES, STRING, BOOL, ENUM = F.TYPE_MESSAGE, F.TYPE_BYTES, F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_ENUM

MESSAGES: dict[str, list[Field]] = {
    # envoy.config.core.v3
    "HeaderValue": [(1, "key", STRING, False, None, None), (2, "value", STRING, False, None, None),
                    (3, "raw_value", BYTES, False, None, None)],
    "HeaderMap": [(1, "headers", MESSAGE, True, "HeaderValue", None)],
    "HeaderValueOption": [(1, "header", MESSAGE, False, "HeaderValue", None),
                          (3, "append_action", ENUM, False, "HeaderAppendAction", None)],
    "Metadata": [(1, "filter_metadata", MESSAGE, True, "Metadata.FilterMetadataEntry", None)],
    # envoy.type.v3
    "HttpStatus": [(1, "code", ENUM, False, "StatusCode", None)],
    # envoy.service.ext_proc.v3
    "ProtocolConfiguration": [(1, "request_body_mode", ENUM, False, "BodySendMode", None),
                              (2, "response_body_mode", ENUM, False, "BodySendMode", None)],
    "HttpHeaders": [(1, "headers", MESSAGE, False, "HeaderMap", None), (3, "end_of_stream", BOOL, False, None, None)],
    "HttpBody": [(1, "body", BYTES, False, None, None), (2, "end_of_stream", BOOL, False, None, None),
                 (3, "end_of_stream_without_message", BOOL, False, None, None)],
    "HttpTrailers": [(1, "trailers", MESSAGE, False, "HeaderMap", None)],
    "ProcessingRequest": [
        (2, "request_headers", MESSAGE, False, "HttpHeaders", "request"),
        (3, "response_headers", MESSAGE, False, "HttpHeaders", "request"),
        (4, "request_body", MESSAGE, False, "HttpBody", "request"),
        (5, "response_body", MESSAGE, False, "HttpBody", "request"),
        (6, "request_trailers", MESSAGE, False, "HttpTrailers", "request"),
        (7, "response_trailers", MESSAGE, False, "HttpTrailers", "request"),
        (8, "metadata_context", MESSAGE, False, "Metadata", None),
        (11, "protocol_config", MESSAGE, False, "ProtocolConfiguration", None),
    ],
    "HeaderMutation": [(1, "set_headers", MESSAGE, True, "HeaderValueOption", None),
                       (2, "remove_headers", STRING, True, None, None)],
    "StreamedBodyResponse": [(1, "body", BYTES, False, None, None), (2, "end_of_stream", BOOL, False, None, None)],
    "BodyMutation": [(1, "body", BYTES, False, None, "mutation"), (2, "clear_body", BOOL, False, None, "mutation"),
                     (3, "streamed_response", MESSAGE, False, "StreamedBodyResponse", "mutation")],
    "CommonResponse": [(2, "header_mutation", MESSAGE, False, "HeaderMutation", None),
                       (3, "body_mutation", MESSAGE, False, "BodyMutation", None),
                       (5, "clear_route_cache", BOOL, False, None, None)],
    "HeadersResponse": [(1, "response", MESSAGE, False, "CommonResponse", None)],
    "BodyResponse": [(1, "response", MESSAGE, False, "CommonResponse", None)],
    "TrailersResponse": [(1, "header_mutation", MESSAGE, False, "HeaderMutation", None)],
    "ImmediateResponse": [(1, "status", MESSAGE, False, "HttpStatus", None),
                          (2, "headers", MESSAGE, False, "HeaderMutation", None),
                          (3, "body", BYTES, False, None, None), (5, "details", STRING, False, None, None)],
    "ProcessingResponse": [
        (1, "request_headers", MESSAGE, False, "HeadersResponse", "response"),
        (2, "response_headers", MESSAGE, False, "HeadersResponse", "response"),
        (3, "request_body", MESSAGE, False, "BodyResponse", "response"),
        (4, "response_body", MESSAGE, False, "BodyResponse", "response"),
        (5, "request_trailers", MESSAGE, False, "TrailersResponse", "response"),
        (6, "response_trailers", MESSAGE, False, "TrailersResponse", "response"),
        (7, "immediate_response", MESSAGE, False, "ImmediateResponse", "response"),
        (8, "dynamic_metadata", MESSAGE, False, ".google.protobuf.Struct", None),
    ],
}
ENUMS: dict[str, list[tuple[str, int]]] = {
    # ProcessingMode.BodySendMode
    "BodySendMode": [("NONE", 0), ("STREAMED", 1), ("BUFFERED", 2), ("BUFFERED_PARTIAL", 3),
                     ("FULL_DUPLEX_STREAMED", 4), ("GRPC", 5)],
    "HeaderAppendAction": [("APPEND_IF_EXISTS_OR_ADD", 0), ("ADD_IF_ABSENT", 1), ("OVERWRITE_IF_EXISTS_OR_ADD", 2),
                           ("OVERWRITE_IF_EXISTS", 3)],
    # envoy.type.v3.StatusCode: the statuses the picker answers with itself (proto3 enums are open: any code reads)
    "StatusCode": [("Empty", 0), ("OK", 200), ("TooManyRequests", 429), ("InternalServerError", 500),
                   ("ServiceUnavailable", 503)],
}


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name=FILE, package=PACKAGE, syntax="proto3",
                                               dependency=["google/protobuf/struct.proto"])
    for name, values in ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for name, fields in MESSAGES.items():
        message = proto.message_type.add(name=name)
        if name == "Metadata":  # map<string, google.protobuf.Struct> filter_metadata = 1
            entry = message.nested_type.add(name="FilterMetadataEntry", options=descriptor_pb2.MessageOptions(
                map_entry=True))
            entry.field.add(name="key", number=1, type=STRING, label=F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=MESSAGE, label=F.LABEL_OPTIONAL,
                            type_name=".google.protobuf.Struct")
        oneofs: list[str] = []
        for number, field_name, kind, repeated, type_name, oneof in fields:
            field = message.field.add(name=field_name, number=number, type=kind,
                                      label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
            if type_name is not None:
                field.type_name = type_name if type_name.startswith(".") else f".{PACKAGE}.{type_name}"
            if oneof is not None:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    message.oneof_decl.add(name=oneof)
                field.oneof_index = oneofs.index(oneof)
    service = proto.service.add(name="ExternalProcessor")
    service.method.add(name="Process", input_type=f".{PACKAGE}.ProcessingRequest",
                       output_type=f".{PACKAGE}.ProcessingResponse", client_streaming=True, server_streaming=True)
    return proto


def _classes() -> dict[str, Any]:
    pool = descriptor_pool.Default()
    pool.FindFileByName(struct_pb2.DESCRIPTOR.name)  # google/protobuf/struct.proto is in the pool (imported above)
    try:
        pool.FindFileByName(FILE)
    except KeyError:
        pool.Add(_file())
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name in MESSAGES}


_CLASSES = _classes()
# The classes, typed Any (built at run time, as generated code would be).
HeaderValue: Any = _CLASSES["HeaderValue"]
HeaderMap: Any = _CLASSES["HeaderMap"]
HeaderValueOption: Any = _CLASSES["HeaderValueOption"]
Metadata: Any = _CLASSES["Metadata"]
HttpStatus: Any = _CLASSES["HttpStatus"]
ProtocolConfiguration: Any = _CLASSES["ProtocolConfiguration"]
HttpHeaders: Any = _CLASSES["HttpHeaders"]
HttpBody: Any = _CLASSES["HttpBody"]
HttpTrailers: Any = _CLASSES["HttpTrailers"]
ProcessingRequest: Any = _CLASSES["ProcessingRequest"]
HeaderMutation: Any = _CLASSES["HeaderMutation"]
StreamedBodyResponse: Any = _CLASSES["StreamedBodyResponse"]
BodyMutation: Any = _CLASSES["BodyMutation"]
CommonResponse: Any = _CLASSES["CommonResponse"]
HeadersResponse: Any = _CLASSES["HeadersResponse"]
BodyResponse: Any = _CLASSES["BodyResponse"]
TrailersResponse: Any = _CLASSES["TrailersResponse"]
ImmediateResponse: Any = _CLASSES["ImmediateResponse"]
ProcessingResponse: Any = _CLASSES["ProcessingResponse"]

BODY_MODES = dict(ENUMS["BodySendMode"])
OVERWRITE_IF_EXISTS_OR_ADD = dict(ENUMS["HeaderAppendAction"])["OVERWRITE_IF_EXISTS_OR_ADD"]
