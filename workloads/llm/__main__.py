"""Entry point of the vllm runtime: ``python -m loom.workloads.llm --config /etc/loom/llm.json``.

Starts the vLLM engine (a child process on the loopback, in the interpreter ``engineExecutable`` names) and
Loom's OpenAI-compatible front on ``port``. An engine that never becomes ready stops the front with exit
code 1 (a crash loop) and writes why, the engine's own fatal error (``ValueError: ...``), to the container's
termination message ($LOOM_TERMINATION_LOG, else /dev/termination-log), which the operator puts on the
InferenceService's Ready condition. SIGTERM drains as the model server does: not ready at
once, ``--drain-seconds`` more of serving, then in-flight requests and streams finish, then the engine stops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from loom.workloads.common.lifecycle import (
    Drain,
    GracefulServer,
    add_drain_arguments,
    check_drain_arguments,
    uvicorn_config,
)
from loom.workloads.server.fetch import read_marker

from .app import build_app
from .config import LlmServerConfig

log = logging.getLogger("loom.workloads.llm")
# Kubernetes keeps at most 4096 bytes of a termination message.
MAX_TERMINATION_MESSAGE = 4096


def write_termination_message(message: str) -> None:
    """The container's termination message: what the kubelet copies into the pod's status when it exits."""
    path = os.environ.get("LOOM_TERMINATION_LOG", "/dev/termination-log")
    data = message.encode("utf-8", "replace")
    if len(data) > MAX_TERMINATION_MESSAGE:
        data = data[: MAX_TERMINATION_MESSAGE - 3] + b"..."
    with contextlib.suppress(OSError):
        Path(path).write_bytes(data)


def resolve_model_folder(config: LlmServerConfig) -> LlmServerConfig:
    """The folder the fetch init step put the model in (it records it in a marker under modelDir), as the
    default runtime finds it; modelDir itself when there is no marker (a local folder)."""
    marker = read_marker(Path(config.model_dir))
    if marker is None:
        return config
    return config.model_copy(update={"model_dir": str(Path(config.model_dir) / marker.folder)})


def with_engine_args(config: LlmServerConfig, extra: list[str]) -> LlmServerConfig:
    """The config with more engine flags after its own (checked as extraArgs are: no flag the front sets)."""
    if not extra:
        return config
    engine = type(config.engine).model_validate(
        {**config.engine.model_dump(), "extra_args": [*config.engine.extra_args, *extra]}
    )
    return config.model_copy(update={"engine": engine})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loom's OpenAI-compatible front over the vLLM engine.")
    parser.add_argument("--config", required=True, help="LlmServerConfig JSON (the rendered ConfigMap)")
    # What differs per pod and so cannot be in the shared config: a multi-pod replica's leader address (the kubelet
    # expands $(LWS_LEADER_ADDRESS) in the command line; operator/kinds/inferenceservice/llm/multinode.py).
    parser.add_argument("--engine-arg", action="append", default=[], metavar="--FLAG[=VALUE]",
                        help="one more vllm flag for the engine (repeatable)")
    add_drain_arguments(parser)
    args = parser.parse_args(argv)
    check_drain_arguments(parser, args)
    config = with_engine_args(resolve_model_folder(LlmServerConfig.from_file(args.config)), args.engine_arg)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    drain = Drain(args.drain_seconds)
    failed: list[str] = []
    server: GracefulServer | None = None

    def stop(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    app = build_app(config, drain=drain, on_engine_failed=stop)
    uvicorn = uvicorn_config(app, config.host, config.port, config.log_level, args.shutdown_timeout)
    server = GracefulServer(uvicorn, drain)
    server.run()
    if failed:
        log.error("exiting: the engine could not start: %s", failed[0])
        write_termination_message(failed[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
