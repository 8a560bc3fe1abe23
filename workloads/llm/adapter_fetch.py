"""Fetch one LoRA adapter's peft files (adapter_config.json, adapter_model.safetensors) into a local folder the
engine loads from: from S3 with the pod's S3 settings (the same environment the model's fetch step uses) or from
the MLflow registry (models:/name/version or models:/name@alias, resolved when fetched). Blocking: the front runs
it in a thread, so requests keep being answered while an adapter downloads."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from loom.workloads.common.s3 import S3Location, download_tree, list_keys, make_client
from loom.workloads.server.config import parse_mlflow_uri

from .adapters import AdapterSource, adapter_folder


def _from_s3(uri: str, dest: Path) -> None:
    location = S3Location.parse(uri.rstrip("/"))
    client = make_client(max_attempts=3)  # a missing adapter is answered at once; retries are for a flaky store
    if not any(True for _ in list_keys(client, location)):
        raise FileNotFoundError(f"nothing found at {uri}")
    download_tree(client, location, dest)


def _from_mlflow(source: AdapterSource, dest: Path) -> str:
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    name, version, alias = parse_mlflow_uri(source.uri)
    client = MlflowClient(tracking_uri=source.tracking_uri)
    found = client.get_model_version_by_alias(name, alias) if alias is not None else None
    resolved = str(found.version) if found is not None else str(version)
    download_artifacts(artifact_uri=f"models:/{name}/{resolved}", dst_path=str(dest),
                       tracking_uri=source.tracking_uri)
    return resolved


def fetch_adapter(source: AdapterSource, root: Path) -> Path:
    """Download ``source`` under ``root`` (``root/<engine name>``) and return the folder holding its
    adapter_config.json. Raises with a message fit for status (no secrets: S3 and MLflow errors name the
    location, never the keys)."""
    final = root / source.engine_name
    if final.is_dir():
        return adapter_folder(final)  # fetched before (the front restarted, the engine did not keep it)
    root.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=".incoming-", dir=root))
    try:
        if source.kind == "s3":
            _from_s3(source.uri, staged)
        else:
            _from_mlflow(source, staged)
        adapter_folder(staged)  # refuse what is not a peft adapter before it is installed
        staged.rename(final)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return adapter_folder(final)


def remove_adapter(source: AdapterSource, root: Path) -> None:
    shutil.rmtree(root / source.engine_name, ignore_errors=True)
