"""Fetch a model into the cache volume before the server starts (the pod's init step).

    python -m loom.workloads.server.fetch --config /etc/loom/server.json

Sources: an S3 prefix (or object), an MLflow registry URI (models:/name/version, models:/name@alias,
models:/name/latest; the resolved version is recorded), or a TrainingJob checkpoint root: its final
export (``<root>/final``: weights + config.json, what handlers load) once training completed, else
the newest checkpoint whose manifest.json exists (the trainer writes the manifest last, so a torn
checkpoint is never served; every file is checked against the manifest's SHA-256).

Layout of the cache volume::

    <modelDir>/<slug>/...        the model files of one version, renamed into place when complete
    <modelDir>/.loom-model.json  which slug is current, its source URI and version (written last)

A replica that finds the same URI and version already recorded skips the download; replicas that
share the volume take a file lock, so only one of them downloads. With the node cache (LOOM_MODEL_NODE_CACHE, a
hostPath folder the operator mounts when its settings name one) an S3 or MLflow model is downloaded once per node
and content (node_cache.py): a second replica on the node links it from there.
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

from ..common.s3 import S3Location, download_file, make_client, sha256_file
from ..trainer.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    checkpoint_dir_name,
    complete_steps,
)
from .config import ServerConfig, parse_mlflow_uri
from .node_cache import CachedFile, NotContentAddressable, content_key, s3_files
from .node_cache_io import NodeCache

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


def list_objects(client: Any, location: S3Location) -> list[dict[str, Any]]:
    """Objects under a prefix with their ETags (a retrained model often has the same sizes)."""
    prefix = location.key + "/" if location.key else ""
    objects: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
        objects.extend(page.get("Contents", []))
    return objects


def _s3_listing(client: Any, uri: str) -> tuple[S3Location, list[dict[str, Any]]]:
    """Objects under a prefix; a URI naming a single object lists just that object."""
    location = S3Location.parse(uri)
    objects = list_objects(client, location)
    if not objects and location.key:
        parent = S3Location(location.bucket, location.key.rsplit("/", 1)[0] if "/" in location.key else "")
        objects = [o for o in list_objects(client, parent) if o["Key"] == location.key]
        location = parent
    if not objects:
        raise FileNotFoundError(f"nothing found at {uri}")
    return location, objects


def _listing_version(objects: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for obj in sorted(objects, key=lambda o: o["Key"]):
        digest.update(f"{obj['Key']}\0{obj.get('ETag', '')}\0{obj.get('Size', 0)}\n".encode())
    return digest.hexdigest()[:16]


def _target(dest: Path, relative: str) -> Path:
    target = dest / relative
    if not target.resolve().is_relative_to(dest.resolve()):
        raise ValueError(f"refusing object key that escapes the cache folder: {relative!r}")
    return target


def _download_listing(client: Any, location: S3Location, objects: list[dict[str, Any]], dest: Path) -> None:
    skip = len(location.key) + 1 if location.key else 0
    for obj in objects:
        relative = obj["Key"][skip:]
        if relative and not relative.endswith("/"):
            download_file(client, S3Location(location.bucket, obj["Key"]), _target(dest, relative))


def training_output(client: Any, root_uri: str) -> tuple[str, dict[str, Any]]:
    """What a TrainingJob's checkpoint root offers to serve, newest first: the final export
    (<root>/final, written when training completed) or else the newest complete checkpoint."""
    root = S3Location.parse(root_uri)
    final = root.child("final")
    final_objects = list_objects(client, final)
    if final_objects:
        return "final-" + _listing_version(final_objects), {"export": final.uri}
    keys = [obj["Key"] for obj in list_objects(client, root)]
    steps = complete_steps(keys, root.key)
    if not steps:
        raise FileNotFoundError(f"no final export and no complete checkpoint (manifest.json) under {root_uri}")
    step = steps[-1]
    return f"step-{step}", {"checkpoint": root.child(checkpoint_dir_name(step)).uri, "step": step}


def _download_checkpoint(client: Any, checkpoint_uri: str, dest: Path) -> None:
    """Download the files a manifest lists, each checked against its recorded SHA-256."""
    location = S3Location.parse(checkpoint_uri)
    manifest_key = location.child(MANIFEST_NAME)
    body = client.get_object(Bucket=manifest_key.bucket, Key=manifest_key.key)["Body"].read()
    manifest = Manifest.model_validate_json(body)
    for entry in manifest.files:
        target = _target(dest, entry.path)
        download_file(client, location.child(entry.path), target)
        if sha256_file(target) != entry.sha256:
            raise ValueError(f"{entry.path} of {checkpoint_uri} does not match its manifest")
    (dest / MANIFEST_NAME).write_bytes(body)


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
    client = make_client()
    if kind == "checkpoint":
        return training_output(client, uri)
    _location, objects = _s3_listing(client, uri)
    return _listing_version(objects), {"objects": len(objects)}


def _download_version(config: ServerConfig, version: str, details: dict[str, Any], dest: Path) -> None:
    uri = config.storage_uri or ""
    kind = config.resolved_storage_kind
    if kind == "mlflow":
        from mlflow.artifacts import download_artifacts

        download_artifacts(artifact_uri=f"models:/{details['name']}/{version}", dst_path=str(dest))
        return
    client = make_client()
    if "checkpoint" in details:
        _download_checkpoint(client, details["checkpoint"], dest)
        return
    location, objects = _s3_listing(client, details.get("export", uri))
    _download_listing(client, location, objects, dest)


def _mlflow_files(name: str, version: str) -> list[CachedFile]:
    """The model version's artifacts (path, size), walked folder by folder."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(f"models:/{name}/{version}")
    files: list[CachedFile] = []
    pending: list[str | None] = [None]
    while pending:
        for info in repo.list_artifacts(pending.pop()):
            if info.is_dir:
                pending.append(info.path)
            else:
                files.append(CachedFile(info.path, int(info.file_size or 0)))
    return sorted(files, key=lambda f: f.path)


def _content(config: ServerConfig, version: str, details: dict[str, Any]) -> tuple[str, list[CachedFile]]:
    """The node cache's key of what `_download_version` would download, and its files."""
    if config.resolved_storage_kind == "mlflow":
        files = _mlflow_files(str(details["name"]), version)
        # An MLflow version's run and source never change; the listing guards against a reused registry.
        return content_key("mlflow", files, {"runId": str(details["runId"]), "source": str(details["source"])}), files
    location, objects = _s3_listing(make_client(), config.storage_uri or "")
    files = s3_files(location.key, objects)
    return content_key("s3", files), files


def _fill(config: ServerConfig, version: str, details: dict[str, Any], staged: Path) -> dict[str, Any]:
    """Download the version into `staged`, through the node cache where there is one; the details to record."""
    cache = NodeCache.from_env(os.environ)
    if cache is None or config.resolved_storage_kind not in ("s3", "mlflow") or not cache.usable():
        _download_version(config, version, details, staged)
        return details
    try:
        key, files = _content(config, version, details)
    except NotContentAddressable as reason:
        log.info("node cache not used for %s: %s", config.storage_uri, reason)
        _download_version(config, version, details, staged)
        return details
    outcome = cache.provide(
        key, files, config.storage_uri or "", lambda dest: _download_version(config, version, details, dest), staged
    )
    return {**details, "nodeCache": {"outcome": outcome, "key": key}}


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
            details = _fill(config, version, details, staged)
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
