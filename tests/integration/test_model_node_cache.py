"""The fetch step through the node cache, against a real S3-compatible server and a real MLflow registry: a second
replica on the node (another model folder, the same node cache) downloads nothing; a changed object (new ETag, same
name and size) misses; a corrupt entry is fetched again. GETs are counted on the S3 client the fetch step makes."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import loom.workloads.server.fetch as fetch_module
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.workloads.server.config import ServerConfig
from loom.workloads.server.node_cache import ENTRY_FILE

pytestmark = [pytest.mark.timeout(600)]


class GetCounter:
    """Counts the GetObject requests every S3 client made by the fetch step sends (the real server answers them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gets = 0
        real = fetch_module.make_client

        def counting_client(*args: Any, **kwargs: Any) -> Any:
            client = real(*args, **kwargs)
            client.meta.events.register("before-call.s3.GetObject", self._count)
            return client

        monkeypatch.setattr(fetch_module, "make_client", counting_client)

    def _count(self, **_: Any) -> None:
        self.gets += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[int]]:
        before, out = self.gets, []
        yield out
        out.append(self.gets - before)


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, s3: S3Endpoint, tmp_path: Path) -> Path:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOOM_MODEL_NODE_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.setenv("LOOM_MODEL_NODE_CACHE_LIMIT_BYTES", str(10 * 2**20))
    return tmp_path / "node-cache"


def replica(tmp_path: Path, pod: str, uri: str) -> ServerConfig:
    return ServerConfig(model_name="m", handler="chargpt", model_dir=str(tmp_path / pod), storage_uri=uri)


def put(s3: S3Endpoint, bucket: str, files: dict[str, bytes]) -> None:
    client = s3.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    for key, body in files.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)


def test_a_second_replica_on_the_node_downloads_nothing_and_a_new_etag_misses(
    s3: S3Endpoint, node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(s3, "cached", {"chat/v1/config.json": b"{}", "chat/v1/weights.bin": b"a" * 4096})
    uri = "s3://cached/chat/v1"
    counter = GetCounter(monkeypatch)

    with counter.counting() as first_gets:
        first = fetch_module.fetch(replica(tmp_path, "pod1", uri))
    with counter.counting() as second_gets:
        second = fetch_module.fetch(replica(tmp_path, "pod2", uri))
    assert first is not None and second is not None
    assert (first.details["nodeCache"]["outcome"], second.details["nodeCache"]["outcome"]) == ("miss", "hit")
    assert (first_gets, second_gets) == ([2], [0])  # each object was served by S3 once
    assert (tmp_path / "pod2" / second.folder / "weights.bin").read_bytes() == b"a" * 4096

    # Retrained: same name, same size, new bytes (a new ETag): a new key, downloaded again.
    put(s3, "cached", {"chat/v1/weights.bin": b"b" * 4096})
    with counter.counting() as retrained_gets:
        retrained = fetch_module.fetch(replica(tmp_path, "pod3", uri))
    assert retrained is not None
    assert retrained.details["nodeCache"]["outcome"] == "miss"
    assert retrained.details["nodeCache"]["key"] != first.details["nodeCache"]["key"]
    assert retrained_gets == [2]
    assert (tmp_path / "pod3" / retrained.folder / "weights.bin").read_bytes() == b"b" * 4096

    # A corrupt entry (a file cut short on the node's disk) is never served: fetched again.
    entry = node / retrained.details["nodeCache"]["key"]
    (entry / "weights.bin").unlink()
    (entry / "weights.bin").write_bytes(b"b")
    with counter.counting() as repaired_gets:
        repaired = fetch_module.fetch(replica(tmp_path, "pod4", uri))
    assert repaired is not None and repaired.details["nodeCache"]["outcome"] == "miss"
    assert repaired_gets == [2]
    assert (tmp_path / "pod4" / repaired.folder / "weights.bin").read_bytes() == b"b" * 4096
    assert (entry / ENTRY_FILE).is_file()


def test_without_the_node_cache_every_replica_downloads(
    s3: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOOM_MODEL_NODE_CACHE", raising=False)
    put(s3, "uncached", {"chat/config.json": b"{}"})
    counter = GetCounter(monkeypatch)
    for pod in ("pod1", "pod2"):
        with counter.counting() as gets:
            record = fetch_module.fetch(replica(tmp_path, pod, "s3://uncached/chat"))
        assert record is not None and "nodeCache" not in record.details
        assert gets == [1]


@pytest.mark.slow
def test_an_mlflow_version_is_downloaded_once_per_node(
    mlflow: MLflowEndpoint, s3: S3Endpoint, node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)
    mlflow_api = importlib.import_module("mlflow")
    pyfunc = importlib.import_module("mlflow.pyfunc")

    class Scale(pyfunc.PythonModel):  # type: ignore[misc]
        def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
            return model_input

    mlflow_api.set_experiment("node-cache")
    with mlflow_api.start_run():
        pyfunc.log_model(name="model", python_model=Scale(), registered_model_name="node-cached")
    downloads = []
    real = fetch_module._download_version

    def counted(*args: Any) -> None:
        downloads.append(args[1])
        real(*args)

    monkeypatch.setattr(fetch_module, "_download_version", counted)
    records = [
        fetch_module.fetch(ServerConfig(model_name="n", handler="mlflow-pyfunc", model_dir=str(tmp_path / pod),
                                        storage_uri="models:/node-cached/1"))
        for pod in ("pod1", "pod2")
    ]
    assert [r.details["nodeCache"]["outcome"] for r in records if r is not None] == ["miss", "hit"]
    assert downloads == ["1"]
    assert (tmp_path / "pod2" / records[1].folder / "MLmodel").is_file()  # type: ignore[union-attr]
