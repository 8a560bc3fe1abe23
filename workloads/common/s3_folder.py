"""A local folder that answers the S3 calls Loom's workloads make, for running a trainer on one machine
(`loom run --local --checkpoint-dir`): checkpoints, their manifests and the exported model go through the very
same code as against S3, laid out as `<folder>/<bucket>/<key>`.

Selected with the endpoint `file:///absolute/folder` (make_client). Writes are atomic (a temporary file, then a
rename), so a reader never sees half of a manifest, as with S3. Only the calls the workloads make are here.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

FILE_SCHEME = "file://"


def _missing(operation: str, key: str) -> ClientError:
    return ClientError({"Error": {"Code": "NoSuchKey", "Message": f"no such key: {key}"}}, operation)


class _Events:
    """No request is ever retried on a folder: handlers registered for retries are never called."""

    def register(self, event: str, handler: Callable[..., Any]) -> None:
        pass


class _Meta:
    events = _Events()


class _Exceptions:
    ClientError = ClientError


class _Paginator:
    def __init__(self, client: FolderClient) -> None:
        self.client = client

    def paginate(self, Bucket: str, Prefix: str = "") -> Iterator[dict[str, Any]]:
        yield {"Contents": list(self.client.objects(Bucket, Prefix))}


class FolderClient:
    """The subset of a boto3 S3 client the workloads use, on `<root>/<bucket>/<key>` files."""

    meta = _Meta()
    exceptions = _Exceptions()

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    @classmethod
    def from_endpoint(cls, endpoint: str) -> FolderClient:
        path = endpoint.removeprefix(FILE_SCHEME)
        if not path.startswith("/"):
            raise ValueError(f"a folder endpoint must be absolute, file:///path: {endpoint!r}")
        return cls(path)

    def _path(self, bucket: str, key: str) -> Path:
        path = (self.root / bucket / key).resolve()
        if self.root not in path.parents:
            raise ValueError(f"key {key!r} leaves the folder")
        return path

    def objects(self, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
        base = self.root / bucket
        if not base.is_dir():
            return
        found = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.startswith(".loom-partial-"):
                key = path.relative_to(base).as_posix()
                if key.startswith(prefix):
                    found.append({"Key": key, "Size": path.stat().st_size})
        yield from sorted(found, key=lambda item: str(item["Key"]))

    def _write(self, target: Path, fill: Callable[[Path], object]) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".loom-partial-", dir=target.parent)
        os.close(handle)
        try:
            fill(Path(temporary))
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------------------------------------- boto3's calls

    def get_paginator(self, name: str) -> _Paginator:
        if name != "list_objects_v2":
            raise NotImplementedError(f"{name} is not available on a folder store")
        return _Paginator(self)

    def upload_file(self, Filename: str, Bucket: str, Key: str, Config: Any = None) -> None:
        self._write(self._path(Bucket, Key), lambda tmp: shutil.copyfile(Filename, tmp))

    def download_file(self, Bucket: str, Key: str, Filename: str, Config: Any = None) -> None:
        source = self._path(Bucket, Key)
        if not source.is_file():
            raise _missing("GetObject", Key)
        shutil.copyfile(source, Filename)

    def put_object(self, Bucket: str, Key: str, Body: bytes) -> dict[str, Any]:
        self._write(self._path(Bucket, Key), lambda tmp: tmp.write_bytes(bytes(Body)))
        return {}

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        source = self._path(Bucket, Key)
        if not source.is_file():
            raise _missing("GetObject", Key)
        return {"Body": io.BytesIO(source.read_bytes()), "ContentLength": source.stat().st_size}

    def delete_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        self._path(Bucket, Key).unlink(missing_ok=True)
        return {}

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        for item in Delete.get("Objects", []):
            self.delete_object(Bucket, item["Key"])
        return {}

    def head_bucket(self, Bucket: str) -> dict[str, Any]:
        if not (self.root / Bucket).is_dir():
            raise ClientError({"Error": {"Code": "404", "Message": "no such bucket"}}, "HeadBucket")
        return {}

    def create_bucket(self, Bucket: str, **_: Any) -> dict[str, Any]:
        (self.root / Bucket).mkdir(parents=True, exist_ok=True)
        return {}
