"""Entry point: ``python -m loom.workloads.server --config /etc/loom/server.json [--fetch]``.

``--fetch`` runs the fetch step in-process first (handy outside Kubernetes; in a pod the operator
runs ``python -m loom.workloads.server.fetch`` as an init step instead). A model that fails to load
stops the server with exit code 1, so Kubernetes shows a crash loop with the reason in the log
rather than a pod that is silently never ready.

SIGTERM drains (lifecycle.py): not ready at once, ``--drain-seconds`` more of serving with keep-alive off,
then no new connections while requests in flight finish (at most ``--shutdown-timeout``), then exit 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from prometheus_client import start_http_server

from .app import build_app
from .config import ServerConfig
from .dataplane import DataPlane
from .fetch import fetch, model_folder
from .handlers import load_handler_class
from .lifecycle import Drain, GracefulServer, add_drain_arguments, check_drain_arguments, uvicorn_config

log = logging.getLogger("loom.workloads.server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loom model server (Open Inference Protocol v2).")
    parser.add_argument("--config", required=True, help="ServerConfig JSON (the rendered ConfigMap)")
    parser.add_argument("--fetch", action="store_true", help="fetch the model into modelDir first")
    add_drain_arguments(parser)
    args = parser.parse_args(argv)
    check_drain_arguments(parser, args)
    config = ServerConfig.from_file(args.config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The predict thread holds the GIL for Python-heavy stretches (a generation loop); with the default
    # 5 ms switch interval the event loop then accepts requests slowly and batches fill poorly.
    sys.setswitchinterval(0.0005)
    if args.fetch:
        fetch(config)
    folder, version = model_folder(config)
    options = {"device": config.device, **config.handler_options}
    model = load_handler_class(config.handler)(config.model_name, version, options)
    drain = Drain(args.drain_seconds)
    app = build_app(config, model, folder, drain)
    plane: DataPlane = app.state.plane
    if config.metrics_port is not None:
        start_http_server(config.metrics_port, addr=config.host, registry=plane.metrics.registry)
    server = GracefulServer(
        uvicorn_config(app, config.host, config.port, config.log_level, args.shutdown_timeout), drain
    )
    failed: list[str] = []

    def stop(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    plane.on_load_failed = stop
    server.run()
    if failed:
        log.error("exiting: model could not be loaded: %s", failed[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
