"""S3 for Feast's file offline store without s3fs.

Feast reads a FileSource's schema through pyarrow's own S3 filesystem, but its Dask offline store
(materialization, historical retrieval) opens ``s3://`` paths through fsspec, which needs s3fs. s3fs
pins aiobotocore, which pins an older botocore than the boto3 the rest of Loom uses, so instead of
adding it this module registers pyarrow's S3 filesystem (already a Feast dependency) as fsspec's
``s3`` protocol when s3fs is absent. Where s3fs is installed it is used unchanged.

Credentials resolve the usual way (AWS_* variables from a Secret, instance roles); the endpoint comes
from the FileSource's ``s3_endpoint_override`` (which Feast hands over as s3fs-style ``client_kwargs``)
or from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any
from urllib.parse import urlparse

import fsspec
from fsspec.implementations.arrow import ArrowFSWrapper
from pyarrow import fs as pafs


def arrow_s3(
    endpoint_url: str | None = None,
    key: str | None = None,
    secret: str | None = None,
    token: str | None = None,
) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem; explicit arguments win over the environment."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, Any] = {"region": os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")}
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or endpoint
        kwargs["scheme"] = parsed.scheme or "https"
        # S3-compatible servers (MinIO, moto, Ceph) want path-style addressing.
        kwargs["force_virtual_addressing"] = False
    if key and secret:
        kwargs.update(access_key=key, secret_key=secret, session_token=token)
    return pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})


class ArrowS3FileSystem(ArrowFSWrapper):  # type: ignore[misc]  # fsspec is untyped
    """fsspec's ``s3`` protocol on pyarrow, accepting the s3fs keyword arguments Feast passes."""

    protocol = ("s3", "s3a")

    def __init__(
        self,
        key: str | None = None,
        secret: str | None = None,
        token: str | None = None,
        client_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        endpoint = (client_kwargs or {}).get("endpoint_url")
        super().__init__(arrow_s3(endpoint, key, secret, token), **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = str(path)
        for prefix in ("s3://", "s3a://"):
            if text.startswith(prefix):
                return text[len(prefix):].rstrip("/")
        return text.rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return name if name.startswith("s3://") else f"s3://{name}"


def ensure_s3_protocol() -> str:
    """Make ``s3://`` paths readable by fsspec; returns which implementation serves them."""
    if importlib.util.find_spec("s3fs") is not None:
        return "s3fs"
    fsspec.register_implementation("s3", ArrowS3FileSystem, clobber=True)
    fsspec.register_implementation("s3a", ArrowS3FileSystem, clobber=True)
    return "pyarrow"
