"""The `loom` command: CRD generation, running the operator, the local dev stack, the demo."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def main() -> None:
    """Loom: a Kubernetes-native MLOps operator."""


@main.command()
@click.option(
    "--write",
    "folders",
    multiple=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Write one file per kind into this folder (repeatable).",
)
def crds(folders: tuple[Path, ...]) -> None:
    """Print the CRDs generated from the API models (or write one file per kind)."""
    from .api.crd import render_all, write_all

    if folders:
        for path in write_all(*folders):
            click.echo(f"wrote {path}")
        return
    sys.stdout.write("".join(render_all().values()))


@main.command()
def operator() -> None:
    """Run the operator against the current kubeconfig (settings from LOOM_* environment variables)."""
    import logging
    import os

    from .main import run

    logging.basicConfig(
        level=os.environ.get("LOOM_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run()


def _register_optional() -> None:
    """Dev-only command groups live outside the operator's import path; add them when present."""
    try:
        from .cli_dev import dev

        main.add_command(dev)
    except ImportError:
        pass
    try:
        from .demo import demo

        main.add_command(demo)
    except ImportError:
        pass


_register_optional()
