"""Entry point: ``python -m loom.workloads.picker`` with its config as JSON in ``LOOM_PICKER_CONFIG`` (as the
operator renders it) or in a file (``--config``). A config that does not validate stops it with exit code 2.
``--endpoints ip:port,...`` replaces the pod watch with a fixed list of stable replicas (tests, benchmarks)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

import uvicorn
from pydantic import ValidationError

from loom.workloads.activator.kube import api_client
from loom.workloads.activator.proxy import Upstream

from .app import NO_REPLICA_WAIT_S, build_admin_app, build_app
from .config import ENV_VAR, PickerConfig
from .decide import Decider
from .gate import gate_for
from .grpc_server import start_grpc
from .kube import ReplicaWatch
from .lease import LeaseElector
from .metrics import PickerMetrics
from .poll import poll_forever
from .state import PickerState, Pod

log = logging.getLogger("loom.workloads.picker")


def load_config(path: str | None) -> PickerConfig:
    return PickerConfig.from_file_or_env(path, ENV_VAR)


def leader_elector(config: PickerConfig) -> LeaseElector | None:
    """With several picker pods (leaderElection), the one that decides whether this one serves; its identity is
    the pod's name (POD_NAME, from the downward API), else the host's."""
    if config.leader_election is None:
        return None
    identity = os.environ.get("POD_NAME") or socket.gethostname()
    return LeaseElector(config.namespace, config.leader_election, identity, api_client())


async def release_when_stopping(servers: list[uvicorn.Server], elector: LeaseElector) -> None:
    """At SIGTERM (uvicorn's should_exit), before the requests in flight finish: the Lease is freed so a standby
    takes over while this pod drains."""
    while not any(s.should_exit for s in servers):
        await asyncio.sleep(0.2)
    await asyncio.to_thread(elector.stop)


def fixed_pods(endpoints: list[str], roles: list[str] | None) -> dict[str, Pod]:
    """The fixed replicas' pods; `roles`: each one's `role[:kv-version]` (disaggregation), in the same order and
    as many (main checks)."""
    pods = {}
    for i, endpoint in enumerate(endpoints):
        role, _, version = roles[i].partition(":") if roles else ("", "", "")
        pods[endpoint] = Pod(f"replica-{i}", "stable", role or None, version or None)
    return pods


async def serve(config: PickerConfig, endpoints: list[str] | None = None,
                kv_addresses: list[str] | None = None, roles: list[str] | None = None) -> None:
    loop = asyncio.get_running_loop()
    state = PickerState(config, PickerMetrics(f"{config.namespace}/{config.service}"))
    watch: ReplicaWatch | None = None
    if endpoints is None:
        watch = ReplicaWatch(config, api_client(),
                             lambda pods: loop.call_soon_threadsafe(state.set_replicas, pods))
        watch.track_label = config.track_label
        watch.disaggregation = config.disaggregation
        ready = watch.synced.is_set
    else:
        state.set_replicas(fixed_pods(endpoints, roles))

        def ready() -> bool:
            return True

    elector = leader_elector(config)
    active = elector.leading if elector is not None else _always
    gate = gate_for(config, state)
    decider = Decider(state, wait_s=NO_REPLICA_WAIT_S, gate=gate)
    servers = [
        uvicorn.Server(uvicorn.Config(build_app(config, state, Upstream(), decider=decider), host=config.host,
                                      port=config.port, log_level=config.log_level, access_log=False)),
        uvicorn.Server(uvicorn.Config(build_admin_app(state, ready, active), host=config.host, port=config.admin_port,
                                      log_level="warning", access_log=False)),
    ]
    grpc_server = None
    if config.ext_proc_port is not None:
        # A gateway's Envoy: the same decisions (and flow control), a 503 at once when no replica is ready (the
        # gateway holds nothing for the picker), fallbacks named for a gateway that retries.
        gateway = Decider(state, wait_s=0.0, fallbacks=config.ext_proc_fallbacks, gate=gate)
        grpc_server = await start_grpc(gateway, config.host, config.ext_proc_port, ready, active)
    if watch is not None:
        watch.start()
    releasing = None
    if elector is not None:
        elector.start()
        releasing = asyncio.ensure_future(release_when_stopping(servers, elector))
    poller = asyncio.ensure_future(poll_forever(state, config.poll_interval_s))
    follower = None
    if config.kv_events is not None:
        from .kv_subscriber import start_following  # pyzmq, msgpack and tokenizers only for precise routing

        follower = start_following(config, state, dict(zip(endpoints or [], kv_addresses or [], strict=False)))
    log.info("endpoint picker for %s/%s on :%d, policy %s", config.namespace, config.service, config.port,
             config.policy)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        if releasing is not None:
            for server in servers:
                server.should_exit = True
            await releasing
        if grpc_server is not None:
            await grpc_server.stop(grace=5)
        poller.cancel()
        if follower is not None:
            follower.cancel()
        if watch is not None:
            watch.stop()


def _always() -> bool:
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loom endpoint picker: prefix-cache-aware routing over replicas.")
    parser.add_argument("--config", help=f"PickerConfig JSON file (default: ${ENV_VAR})")
    parser.add_argument("--endpoints", help="ip:port,... of fixed replicas instead of watching pods")
    parser.add_argument("--kv-events", help="tcp://ip:port,... each fixed replica's KV-event publisher, in the "
                        "order of --endpoints (default: the replica's address and kvEvents.port)")
    parser.add_argument("--roles", help="role[:kv-version],... each fixed replica's prefill or decode role and "
                        "kv-version (disaggregation), in the order of --endpoints")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = load_config(args.config)
    except (OSError, ValueError, ValidationError) as exc:
        log.error("invalid picker config: %s", exc)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    endpoints = [e for e in args.endpoints.split(",") if e] if args.endpoints else None
    kv_addresses = [a for a in args.kv_events.split(",") if a] if args.kv_events else None
    roles = args.roles.split(",") if args.roles else None
    if endpoints is not None and roles is not None and len(roles) != len(endpoints):
        log.error("--roles names %d replicas, --endpoints %d", len(roles), len(endpoints))
        return 2
    # uvicorn handles SIGTERM during serve() and raises it again once serve() returns, with the handler that was
    # there before: the default one would end the process then, before serve's own cleanup (the gRPC server's
    # grace, a leader's Lease released). This one lets serve() finish; the process exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    asyncio.run(serve(config, endpoints, kv_addresses, roles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
