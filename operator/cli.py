"""The `loom` command: CRD generation, running the operator, and command groups found through entry points."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from pathlib import Path

import click


@click.group()
# The installed distribution's version (the images run `loom --version` as their smoke test).
@click.version_option(package_name="loom", prog_name="loom")
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
    from .core.observability import configure_logging
    from .main import PortInUse, run
    from .settings import OperatorSettings

    settings = OperatorSettings.from_env()
    configure_logging(settings.log_level, settings.log_format)  # text or json; lines about an object name it
    try:
        run(settings)
    except PortInUse as error:
        raise click.ClickException(str(error)) from None


CLI_GROUP = "loom.cli"


def _missing(module: str, error: ModuleNotFoundError) -> bool:
    """True when `module` itself (or a package above it) is absent, not when something it imports is broken."""
    return error.name is not None and (module == error.name or module.startswith(f"{error.name}."))


def _register_optional() -> None:
    """Add command groups other distributions of Loom declare under the `loom.cli` entry-point group.

    `loom dev` lives in loom.devstack, which a checkout has and a container image does not: the operator
    never imports it by name, and an entry point whose module is absent is skipped. A module that is
    present but fails to import still raises, so a broken `loom dev` is not silently hidden.
    """
    for entry in entry_points(group=CLI_GROUP):
        try:
            command = entry.load()
        except ModuleNotFoundError as error:
            if _missing(entry.module, error):
                continue
            raise
        if isinstance(command, click.Command) and entry.name not in main.commands:
            main.add_command(command, entry.name)


_register_optional()
