"""Fetch a model into the cache volume before the server starts (the pod's init step).

    python -m loom.workloads.server.fetch --config /etc/loom/server.json

Sources: an S3 prefix (or object), an MLflow registry URI (models:/name/version, models:/name@alias,
models:/name/latest; the resolved version is recorded), or a TrainingJob checkpoint root (the
newest checkpoint whose manifest.json exists; the trainer writes the manifest last, so a torn
checkpoint is never served).

Layout of the cache volume::

    <modelDir>/<slug>/...        the model files of one version, renamed into place when complete
    <modelDir>/.loom-model.json  which slug is current, its source URI and version (written last)

A replica that finds the same URI and version already recorded skips the download; replicas that
share the volume take a file lock, so only one of them downloads.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loom.workloads.server.config import ServerConfig, parse_mlflow_uri

log = logging.getLogger("loom.workloads.server.fetch")

MARKER = ".loom-model.json"


@dataclass
class FetchedModel:
    """What the marker records and the server reads back."""

    uri: str
    kind: str
    version: str
    folder: str  # relative to modelDir
    fetched_at: float
    details: dict[str, Any]

    @property
    def slug(self) -> str:
        return self.folder


def read_marker(model_dir: Path) -> FetchedModel | None:
    try:
        return FetchedModel(**json.loads((model_dir / MARKER).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def model_folder(config: ServerConfig) -> tuple[Path, str | None]:
    """Where the server loads the model from, and the version the fetch step recorded."""
    if config.resolved_storage_kind == "local" and config.storage_uri:
        return Path(config.storage_uri), config.model_version
    model_dir = Path(config.model_dir)
    marker = read_marker(model_dir)
    if marker is None:
        return model_dir, config.model_version
    return model_dir / marker.folder, config.model_version or marker.version


# ----------------------------------------------------------------------------------------- S3


def s3_client() -> Any:
    """boto3 client from the environment (AWS_* variables, AWS_ENDPOINT_URL_S3), with retries."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 8}))


def split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"s3 URI without a bucket: {uri!r}")
    return bucket, key


def list_objects(client: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objects.extend(page.get("Contents", []))
    return objects


def _s3_listing(client: Any, uri: str) -> tuple[str, str, list[dict[str, Any]]]:
    """Objects under a prefix; a URI naming a single object lists just that object."""
    bucket, key = split_s3(uri)
    prefix = key if not key or key.endswith("/") else key + "/"
    objects = list_objects(client, bucket, prefix)
    if not objects and key:
        objects = [o for o in list_objects(client, bucket, key) if o["Key"] == key]
        prefix = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    if not objects:
        raise FileNotFoundError(f"nothing found at {uri}")
    return bucket, prefix, objects


def _listing_version(objects: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for obj in sorted(objects, key=lambda o: o["Key"]):
        digest.update(f"{obj['Key']}\0{obj.get('ETag', '')}\0{obj.get('Size', 0)}\n".encode())
    return digest.hexdigest()[:16]


def _download(client: Any, bucket: str, prefix: str, objects: list[dict[str, Any]], dest: Path) -> None:
    for obj in objects:
        relative = obj["Key"][len(prefix) :]
        if not relative or relative.endswith("/"):
            continue
        target = dest / relative
        if not target.resolve().is_relative_to(dest.resolve()):
            raise ValueError(f"refusing object key that escapes the cache folder: {obj['Key']!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, obj["Key"], str(target))  # multipart + retries inside boto3


def latest_checkpoint(client: Any, root_uri: str) -> tuple[str, dict[str, Any]]:
    """The newest complete checkpoint under a TrainingJob's checkpoint root: (prefix URI, manifest)."""
    bucket, key = split_s3(root_uri)
    prefix = key if not key or key.endswith("/") else key + "/"
    manifests = [o for o in list_objects(client, bucket, prefix) if o["Key"].endswith("/manifest.json")]
    best: tuple[int, str, dict[str, Any]] | None = None
    for obj in manifests:
        manifest = json.loads(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
        step = int(manifest.get("step", -1))
        if best is None or (step, obj["Key"]) > (best[0], best[1]):
            best = (step, obj["Key"], manifest)
    if best is None:
        raise FileNotFoundError(f"no complete checkpoint (manifest.json) under {root_uri}")
    checkpoint_prefix = best[1][: -len("manifest.json")]
    return f"s3://{bucket}/{checkpoint_prefix}", best[2]


# ------------------------------------------------------------------------------------- fetching


@contextlib.contextmanager
def _locked(model_dir: Path) -> Iterator[None]:
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _slug(version: str) -> str:
    return "v-" + re.sub(r"[^A-Za-z0-9_.-]", "_", version)[:80]


def _install(model_dir: Path, record: FetchedModel, staged: Path) -> None:
    """Move a complete download into place, then write the marker (last, atomically)."""
    final = model_dir / record.folder
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    tmp = model_dir / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=2))
    os.replace(tmp, model_dir / MARKER)
    for old in model_dir.iterdir():  # earlier versions: the volume is a cache, not an archive
        if old.is_dir() and old.name.startswith("v-") and old.name != record.folder:
            shutil.rmtree(old, ignore_errors=True)


def _resolve(config: ServerConfig) -> tuple[str, dict[str, Any]]:
    """The version the source holds now, and details to record; no download yet."""
    uri = config.storage_uri or ""
    kind = config.resolved_storage_kind
    if kind == "mlflow":
        from mlflow.tracking import MlflowClient

        name, version, alias = parse_mlflow_uri(uri)
        client = MlflowClient()
        if alias is not None:
            found = client.get_model_version_by_alias(name, alias)
        elif version == "latest":
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise FileNotFoundError(f"registered model {name!r} has no versions")
            found = max(versions, key=lambda v: int(v.version))
        else:
            found = client.get_model_version(name, str(version))
        details = {"name": name, "alias": alias, "runId": found.run_id, "source": found.source}
        return str(found.version), details
    client = s3_client()
    if kind == "checkpoint":
        checkpoint_uri, manifest = latest_checkpoint(client, uri)
        version = f"step-{manifest.get('step', 'unknown')}"
        return version, {"checkpoint": checkpoint_uri, "step": manifest.get("step")}
    _bucket, _prefix, objects = _s3_listing(client, uri)
    return _listing_version(objects), {"objects": len(objects)}


def _download_version(config: ServerConfig, version: str, details: dict[str, Any], dest: Path) -> None:
    uri = config.storage_uri or ""
    kind = config.resolved_storage_kind
    if kind == "mlflow":
        from mlflow.artifacts import download_artifacts

        download_artifacts(artifact_uri=f"models:/{details['name']}/{version}", dst_path=str(dest))
        return
    client = s3_client()
    source = details["checkpoint"] if kind == "checkpoint" else uri
    bucket, prefix, objects = _s3_listing(client, source)
    _download(client, bucket, prefix, objects, dest)


def fetch(config: ServerConfig) -> FetchedModel | None:
    """Make the cache volume hold the model the config names; a no-op when it already does."""
    kind = config.resolved_storage_kind
    if config.storage_uri is None or kind == "local":
        log.info("no remote storageUri: serving %s as it is", config.storage_uri or config.model_dir)
        return None
    model_dir = Path(config.model_dir)
    version, details = _resolve(config)
    with _locked(model_dir):
        current = read_marker(model_dir)
        if (
            current is not None
            and current.uri == config.storage_uri
            and current.version == version
            and (model_dir / current.folder).is_dir()
        ):
            log.info("cache already holds %s version %s: nothing to download", config.storage_uri, version)
            return current
        started = time.monotonic()
        staged = Path(tempfile.mkdtemp(prefix=".incoming-", dir=model_dir))
        try:
            _download_version(config, version, details, staged)
            record = FetchedModel(
                uri=config.storage_uri, kind=kind, version=version, folder=_slug(version),
                fetched_at=time.time(), details=details,
            )
            _install(model_dir, record, staged)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        log.info(
            "fetched %s version %s into %s in %.1fs",
            config.storage_uri, version, model_dir / record.folder, time.monotonic() - started,
        )
        return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch the served model into the cache volume.")
    parser.add_argument("--config", required=True, help="ServerConfig JSON (the rendered ConfigMap)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = ServerConfig.from_file(args.config)
    try:
        record = fetch(config)
    except Exception as exc:
        log.error("fetching %s failed: %s: %s", config.storage_uri, type(exc).__name__, exc)
        return 1
    print(json.dumps(asdict(record) if record else {"uri": config.storage_uri, "kind": "local"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
