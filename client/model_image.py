"""`loom model push` and `loom model pull`: a model as an OCI image (issue 48).

    loom model push ./chargpt-final registry.example.com/ml/chargpt:v3
    loom model push s3://models/chargpt/final registry.example.com/ml/chargpt:v3
    loom model push models:/chargpt@champion registry.example.com/ml/chargpt:champion
    loom model pull registry.example.com/ml/chargpt@sha256:... ./here

The source is a local folder, an S3 prefix (the S3 settings of the environment: AWS_* and AWS_ENDPOINT_URL) or an
MLflow registry URI (MLFLOW_TRACKING_URI); the last two are downloaded first with the model server's own fetch code.
The push prints the image by digest, which is what `model.uri: oci://...` pins; each large file is a layer of its
own, so pushing a new version sends only the files that changed (loom.workloads.common.oci.image).
Credentials for a registry that asks for them: LOOM_REGISTRY_USERNAME and LOOM_REGISTRY_PASSWORD.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click

from loom.workloads.common.oci.image import DEFAULT_LARGE_FILE_BYTES
from loom.workloads.common.oci.reference import ImageReference, ReferenceError, parse_reference
from loom.workloads.common.oci.registry import Credentials, Registry, RegistryError
from loom.workloads.common.oci.transfer import pull_folder, push_folder


def credentials_from_env() -> Credentials | None:
    username, password = os.environ.get("LOOM_REGISTRY_USERNAME"), os.environ.get("LOOM_REGISTRY_PASSWORD")
    return Credentials(username, password or "") if username else None


@contextlib.contextmanager
def model_folder(source: str) -> Iterator[tuple[Path, str | None]]:
    """The source as a local folder (downloaded into a temporary one for S3 and MLflow), and its version label
    (the MLflow version; None for a folder or an S3 prefix)."""
    if not source.startswith(("s3://", "models:/")):
        folder = Path(source)
        if not folder.is_dir():
            raise click.UsageError(f"{source}: not a folder, an s3:// prefix or a models:/ URI")
        yield folder, None
        return
    from loom.workloads.server.config import ServerConfig
    from loom.workloads.server.fetch import fetch

    with tempfile.TemporaryDirectory(prefix="loom-model-source-") as work:
        record = fetch(ServerConfig(model_name="model", storage_uri=source, model_dir=work))
        assert record is not None  # a remote source is always fetched
        yield Path(work) / record.folder, record.version if record.kind == "mlflow" else None


def _target(text: str) -> ImageReference:
    try:
        image = parse_reference(text)
    except ReferenceError as error:
        raise click.BadParameter(str(error)) from error
    if image.digest:
        raise click.BadParameter(f"{text}: push to a repository or a tag; the digest is what the push prints")
    return image


@click.group()
def model() -> None:
    """Models as OCI images: push a model folder to a registry, pull one back."""


@model.command()
@click.argument("source")
@click.argument("target")
@click.option("--name", default=None, help="Model name recorded in the image (default: the repository's last part).")
@click.option("--version", "version", default=None, help="Version label recorded (default: the MLflow version).")
@click.option("--large-file-bytes", type=int, default=DEFAULT_LARGE_FILE_BYTES, show_default=True,
              help="Files at least this large get a layer of their own; smaller ones share one.")
@click.option("--plain-http/--https", default=None, help="Default: plain HTTP for a registry on loopback only.")
def push(source: str, target: str, name: str | None, version: str | None, large_file_bytes: int,
         plain_http: bool | None) -> None:  # fmt: skip
    """Pack SOURCE (a folder, s3://bucket/prefix or models:/name@alias) and push it to TARGET
    (<registry>/<repository>[:tag]); print the image by digest."""
    image = _target(target)
    try:
        with model_folder(source) as (folder, found_version), Registry(
            image.registry, credentials_from_env(), plain_http=plain_http
        ) as registry:  # fmt: skip
            result = push_folder(
                folder, image, registry, name=name, version=version or found_version, large_file_bytes=large_file_bytes
            )
    except RegistryError as error:
        raise click.ClickException(error.message) from error
    except (FileNotFoundError, ValueError) as error:
        raise click.ClickException(f"{source}: {error}") from error
    click.echo(
        f"pushed {result.layers} layers: {result.uploaded_bytes} bytes uploaded, {result.skipped_bytes} already in "
        f"the registry", err=True,
    )  # fmt: skip
    click.echo(result.image.uri)


@model.command()
@click.argument("image")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--plain-http/--https", default=None, help="Default: plain HTTP for a registry on loopback only.")
def pull(image: str, dest: Path, plain_http: bool | None) -> None:
    """Unpack a model image IMAGE ([oci://]<registry>/<repository>[:tag|@digest]) into the folder DEST."""
    try:
        reference = parse_reference(image)
        with Registry(reference.registry, credentials_from_env(), plain_http=plain_http) as registry:
            result = pull_folder(reference, registry, dest)
    except ReferenceError as error:
        raise click.BadParameter(str(error)) from error
    except RegistryError as error:
        raise click.ClickException(error.message) from error
    click.echo(f"{len(result.files)} files, {result.fetched_bytes} bytes from the registry", err=True)
    click.echo(result.image.uri)
