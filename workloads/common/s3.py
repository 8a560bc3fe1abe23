"""Small, generic S3 helpers shared by the workloads (trainer checkpoints, model-server downloads).

Credentials come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, injected from a
Secret) through boto3's normal resolution; only the endpoint URL is passed explicitly. Retries with
exponential back-off and jitter come from botocore ("standard" mode), multipart from boto3's transfer
manager.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from .s3_folder import FILE_SCHEME, FolderClient

# 8 MiB parts: the S3 minimum is 5 MiB and larger parts cost latency on small checkpoints.
DEFAULT_TRANSFER = TransferConfig(
    multipart_threshold=8 * 1024 * 1024,
    multipart_chunksize=8 * 1024 * 1024,
    max_concurrency=8,
    use_threads=True,
)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3:// URI: {uri!r}")
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"S3 URI without bucket: {uri!r}")
        return cls(bucket, key.strip("/"))

    def child(self, *parts: str) -> S3Location:
        key = "/".join(p.strip("/") for p in (self.key, *parts) if p.strip("/"))
        return S3Location(self.bucket, key)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"


def make_client(endpoint_url: str | None = None, max_attempts: int = 10) -> Any:
    """A boto3 S3 client; endpoint falls back to AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL from the env. A `file:///folder`
    endpoint gives a FolderClient: that folder stands in for S3."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and endpoint.startswith(FILE_SCHEME):
        # A local folder standing in for the bucket (the SDK's local mode): same calls, same layout.
        return FolderClient.from_endpoint(endpoint)
    config = Config(
        retries={"max_attempts": max_attempts, "mode": "standard"},
        # Path-style addressing works with every S3-compatible server (MinIO, moto, Ceph).
        s3={"addressing_style": "path"},
        connect_timeout=10,
        read_timeout=60,
        max_pool_connections=32,
    )
    return boto3.client("s3", endpoint_url=endpoint or None, config=config)


def sha256_file(path: Path, chunk: int = 4 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def list_keys(client: Any, location: S3Location) -> Iterator[tuple[str, int]]:
    """(key, size) of every object under the location's key prefix."""
    prefix = location.key + "/" if location.key else ""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=location.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            yield item["Key"], int(item["Size"])


def upload_file(client: Any, path: Path, location: S3Location, transfer: TransferConfig = DEFAULT_TRANSFER) -> None:
    client.upload_file(str(path), location.bucket, location.key, Config=transfer)


def download_file(client: Any, location: S3Location, path: Path, transfer: TransferConfig = DEFAULT_TRANSFER) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    client.download_file(location.bucket, location.key, str(partial), Config=transfer)
    # Readers never see half-written files.
    os.replace(partial, path)


def download_tree(client: Any, location: S3Location, destination: Path) -> list[Path]:
    """Mirror every object under the prefix into destination (keeping relative paths)."""
    written = []
    prefix_len = len(location.key) + 1 if location.key else 0
    for key, _size in list_keys(client, location):
        relative = key[prefix_len:]
        if not relative or relative.endswith("/"):
            continue
        target = destination / relative
        download_file(client, S3Location(location.bucket, key), target)
        written.append(target)
    return written
