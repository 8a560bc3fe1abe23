"""Entry point: ``python -m loom.workloads.activator`` with its config as JSON in ``LOOM_ACTIVATOR_CONFIG`` (as the
operator renders it) or in a file (``--config``). A config that does not validate stops it with exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import uvicorn
from pydantic import ValidationError

from .app import build_admin_app, build_app
from .config import ENV_VAR, ActivatorConfig
from .hold import Holder
from .kube import KubeWaker, PodWatch, api_client
from .metrics import ActivatorMetrics
from .proxy import Upstream
from .targets import Targets

log = logging.getLogger("loom.workloads.activator")


def load_config(path: str | None) -> ActivatorConfig:
    return ActivatorConfig.from_file_or_env(path, ENV_VAR)


async def serve(config: ActivatorConfig) -> None:
    loop = asyncio.get_running_loop()
    api = api_client()
    targets = Targets()
    metrics = ActivatorMetrics(f"{config.namespace}/{config.service}")
    watch = PodWatch(config, api, lambda endpoints: loop.call_soon_threadsafe(targets.set, endpoints))
    holder = Holder(
        targets, KubeWaker(config, api), metrics, max_held=config.max_held, max_held_bytes=config.max_held_bytes
    )
    app = build_app(config, holder, Upstream(), metrics)
    admin = build_admin_app(metrics, watch.synced.is_set)
    servers = [
        uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                      access_log=False)),
        uvicorn.Server(uvicorn.Config(admin, host=config.host, port=config.admin_port, log_level="warning",
                                      access_log=False)),
    ]  # fmt: skip
    watch.start()
    log.info(
        "activator for %s/%s on :%d (bound %gs, at most %d held)",
        config.namespace, config.service, config.port, config.timeout_seconds, config.max_held,
    )  # fmt: skip
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        watch.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loom activator: holds requests while a service wakes from zero.")
    parser.add_argument("--config", help=f"ActivatorConfig JSON file (default: ${ENV_VAR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = load_config(args.config)
    except (OSError, ValueError, ValidationError) as exc:
        log.error("invalid activator config: %s", exc)
        return 2
    logging.getLogger().setLevel(config.log_level.upper())
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
