"""Entry point: ``python -m loom.workloads.router --config /etc/loom/router.json``.

A config that does not validate, or a condition that does not compile, stops the router at once
with exit code 2 and every problem in the log (the controller reports the same problems as a
condition before it ever renders such a config).

SIGTERM drains as the model server does (loom.workloads.common.lifecycle): not ready at once, ``--drain-seconds``
more of serving with keep-alive off, then no new connections while requests and streams in flight finish (at most
``--shutdown-timeout``), exit 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from loom.workloads.common.lifecycle import (
    Drain,
    GracefulServer,
    add_drain_arguments,
    check_drain_arguments,
    uvicorn_config,
)

from .app import build_app
from .conditions import ConditionsError, compile_conditions
from .config import RouterConfig

log = logging.getLogger("loom.workloads.router")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loom InferenceGraph router (Open Inference Protocol v2).")
    parser.add_argument("--config", required=True, help="RouterConfig JSON (the rendered ConfigMap)")
    add_drain_arguments(parser)
    args = parser.parse_args(argv)
    check_drain_arguments(parser, args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = RouterConfig.from_file(args.config)
        conditions = compile_conditions(config)
    except (OSError, ValueError, ValidationError, ConditionsError) as exc:
        log.error("invalid router config %s: %s", args.config, exc)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    drain = Drain(args.drain_seconds)
    app = build_app(config, conditions=conditions, drain=drain)
    server = GracefulServer(
        uvicorn_config(app, config.host, config.port, config.log_level, args.shutdown_timeout), drain
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
