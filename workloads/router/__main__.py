"""Entry point: ``python -m loom.workloads.router --config /etc/loom/router.json``.

A config that does not validate, or a condition that does not compile, stops the router at once
with exit code 2 and every problem in the log (the controller reports the same problems as a
condition before it ever renders such a config).
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pydantic import ValidationError

from .app import build_app
from .conditions import ConditionsError, compile_conditions
from .config import RouterConfig

log = logging.getLogger("loom.workloads.router")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loom InferenceGraph router (Open Inference Protocol v2).")
    parser.add_argument("--config", required=True, help="RouterConfig JSON (the rendered ConfigMap)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = RouterConfig.from_file(args.config)
        conditions = compile_conditions(config)
    except (OSError, ValueError, ValidationError, ConditionsError) as exc:
        log.error("invalid router config %s: %s", args.config, exc)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    app = build_app(config, conditions=conditions)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False)
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
