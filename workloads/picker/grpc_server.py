"""The picker's gRPC side, for a gateway's Envoy: Envoy's ExternalProcessor service (one ext_proc stream per HTTP
request, extproc.py) and the standard grpc.health.v1 service, on `ext_proc_port`.

Health, by service name, as GIE's reference picker answers it (gateways and kubelet probes ask these):
`liveness`: SERVING while the process answers; `readiness`, the empty name (a load balancer's overall check),
`inference-extension` (GIE's chart's probe) and `envoy.service.ext_proc.v3.ExternalProcessor`: SERVING once the
replicas are listed and this picker is the active one, NOT_SERVING on a standby (`active` false) or before its first
pod list; any other name: SERVICE_UNKNOWN.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import protocol as pb
from .decide import Decider
from .extproc import ExtProcStream

log = logging.getLogger("loom.workloads.picker")

EXT_PROC_SERVICE = pb.SERVICE
LIVENESS = "liveness"
READINESS = "readiness"
# The name GIE's own chart probes an endpoint picker with when it runs without leader election.
INFERENCE_EXTENSION = "inference-extension"
# grpc.health.v1.HealthCheckResponse.ServingStatus
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def health_status(service: str, synced: bool, active: bool) -> int:
    """Pure: the answer to a health check of `service` (a ServingStatus value)."""
    if service == LIVENESS:
        return SERVING
    if service in (READINESS, "", EXT_PROC_SERVICE, INFERENCE_EXTENSION):
        return SERVING if synced and active else NOT_SERVING
    return SERVICE_UNKNOWN


class ExternalProcessor:
    """Envoy's ExternalProcessor service: its one bidirectional method, Process."""

    def __init__(self, decider: Decider) -> None:
        self.decider = decider

    async def process(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                      ) -> AsyncIterator[Any]:
        stream = ExtProcStream(self.decider)
        try:
            async for message in request_iterator:
                for answer in await stream.handle(message):
                    yield answer
        finally:
            stream.close()  # the HTTP request ended (answered, reset or abandoned): free its place


class Health:
    """grpc.health.v1.Health: Check, List, Watch (add_HealthServicer_to_server registers each)."""

    def __init__(self, synced: Callable[[], bool], active: Callable[[], bool]) -> None:
        self.synced, self.active = synced, active

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_status(request.service, self.synced(), self.active()))

    async def List(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        synced, active = self.synced(), self.active()
        return health_pb2.HealthListResponse(statuses={
            service: health_pb2.HealthCheckResponse(status=health_status(service, synced, active))
            for service in (LIVENESS, READINESS, EXT_PROC_SERVICE)})

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served; use Check")
        yield health_pb2.HealthCheckResponse()  # pragma: no cover (abort raises)


async def start_grpc(decider: Decider, host: str, port: int, synced: Callable[[], bool],
                     active: Callable[[], bool] = lambda: True) -> grpc.aio.Server:
    """Start the ext_proc and health services on host:port (the caller stops the server)."""
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        ExternalProcessor(decider).process, request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=pb.ProcessingResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.SERVICE, {"Process": handler}),))
    health_pb2_grpc.add_HealthServicer_to_server(Health(synced, active), server)
    address = f"[::]:{port}" if host in ("0.0.0.0", "::") else f"{host}:{port}"
    server.add_insecure_port(address)
    await server.start()
    log.info("ext_proc (GIE endpoint-picker protocol) and gRPC health on %s", address)
    return server
