"""The model server fetching from a real S3 server and a real MLflow registry, then serving the model
from a real uvicorn process (the same commands the operator renders: fetch init step, then serve)."""

from __future__ import annotations

import contextlib
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from loom.devstack.servers import MLflowEndpoint, S3Endpoint, free_port
from loom.workloads.common.s3 import sha256_file
from loom.workloads.server.chargpt_handler import save_for_serving
from loom.workloads.server.config import ServerConfig
from loom.workloads.server.fetch import MARKER
from loom.workloads.server.fetch import fetch as fetch_model
from loom.workloads.server.testing import child_env, model_server
from loom.workloads.trainer.checkpoint.manifest import FileEntry, Manifest
from loom.workloads.trainer.examples import chargpt

# Generous: each step starts a real process (MLflow, uvicorn), slow on a small shared machine.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def fetch(config: Path, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    result = subprocess.run(
        [sys.executable, "-m", "loom.workloads.server.fetch", "--config", str(config)],
        capture_output=True, text=True, env=child_env(env), timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def write_config(path: Path, **fields: Any) -> Path:
    path.write_text(json.dumps({"port": free_port(), "host": "127.0.0.1", "device": "cpu", **fields}))
    return path


def upload_folder(s3: S3Endpoint, folder: Path, bucket: str, prefix: str) -> None:
    client = s3.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


def tiny_gpt(seed: int) -> chargpt.GPT:
    torch.manual_seed(seed)
    return chargpt.GPT(chargpt.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()


def test_chargpt_from_s3_is_fetched_once_served_and_refetched_when_it_changes(
    s3: S3Endpoint, tmp_path: Path
) -> None:
    model = tiny_gpt(1)
    upload_folder(s3, save_for_serving(model, tmp_path / "export"), "models", "chargpt/current")
    cache = tmp_path / "cache"
    config = write_config(
        tmp_path / "server.json", modelName="chargpt", modelVersion="1", handler="chargpt",
        modelDir=str(cache), storageUri="s3://models/chargpt/current",
    )
    first, _ = fetch(config, s3.env())
    assert first["kind"] == "s3"
    assert (cache / first["folder"] / "model.pt").is_file()
    again, log = fetch(config, s3.env())  # a second replica on the same cache volume
    assert again == first
    assert "nothing to download" in log

    with model_server(config, tmp_path / "server.log", s3.env()) as url:
        expected = chargpt.generate(model, "Tom said", max_new_tokens=12, temperature=0)
        body = {"text_input": "Tom said", "parameters": {"temperature": 0, "max_tokens": 12}, "id": "g-1"}
        answer = httpx.post(f"{url}/v2/models/chargpt/generate", json=body, timeout=30).json()
        assert answer == {"model_name": "chargpt", "model_version": "1", "text_output": expected, "id": "g-1"}
        infer = httpx.post(
            f"{url}/v2/models/chargpt/versions/1/infer",
            json={
                "inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["Tom said", "Huck"]}],
                "parameters": {"temperature": 0, "max_tokens": 5},
            },
            timeout=30,
        ).json()
        assert infer["outputs"][0]["data"] == [
            expected[:5], chargpt.generate(model, "Huck", max_new_tokens=5, temperature=0)
        ]
        with httpx.stream("POST", f"{url}/v2/models/chargpt/generate_stream", json=body, timeout=30) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        streamed = [json.loads(event)["text_output"] for event in events]
        assert "".join(streamed) == expected
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'loom_server_requests_total{code="200",endpoint="generate",model="chargpt"} 1.0' in metrics

    # The training job publishes new weights under the same URI: the next fetch replaces the cache.
    upload_folder(s3, save_for_serving(tiny_gpt(2), tmp_path / "export2"), "models", "chargpt/current")
    second, _ = fetch(config, s3.env())
    assert second["version"] != first["version"]
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [second["folder"]]


def test_training_job_output_prefers_the_final_export_else_the_newest_complete_checkpoint(
    s3: S3Endpoint, tmp_path: Path
) -> None:
    client = s3.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket="jobs")
    root = "gpt-run/checkpoints"
    shard = tmp_path / "__0_0.distcp"
    for step in (10, 20, 30):
        shard.write_bytes(f"weights at step {step}".encode())
        client.upload_file(str(shard), "jobs", f"{root}/step-{step:09d}/__0_0.distcp")
        if step == 30:
            continue  # torn: its manifest was never written
        manifest = Manifest(
            step=step, world_size=1, engine="fsdp", created_at=time.time(),
            files=[FileEntry(path="__0_0.distcp", size=shard.stat().st_size, sha256=sha256_file(shard))],
        )
        client.put_object(Bucket="jobs", Key=f"{root}/step-{step:09d}/manifest.json", Body=manifest.model_dump_json())
    config = write_config(
        tmp_path / "server.json", modelName="gpt", handler="chargpt", modelDir=str(tmp_path / "cache"),
        storageUri=f"s3://jobs/{root}", storageKind="checkpoint",
    )
    record, _ = fetch(config, s3.env())
    assert (record["version"], record["details"]["step"]) == ("step-20", 20)
    assert (tmp_path / "cache" / record["folder"] / "__0_0.distcp").read_bytes() == b"weights at step 20"

    upload_folder(s3, save_for_serving(tiny_gpt(3), tmp_path / "final"), "jobs", f"{root}/final")
    record, _ = fetch(config, s3.env())
    assert record["version"].startswith("final-")
    assert (tmp_path / "cache" / record["folder"] / "config.json").is_file()


def test_mlflow_registry_alias_is_resolved_recorded_and_served(
    mlflow: MLflowEndpoint, s3: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracking_uri = mlflow.url  # the fixture; `mlflow` the library is imported under other names
    mlflow_client = importlib.import_module("mlflow")
    pyfunc = importlib.import_module("mlflow.pyfunc")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)

    class Affine(pyfunc.PythonModel):  # type: ignore[misc]
        def __init__(self, scale: float) -> None:
            self.scale = scale

        # No type hints: MLflow would read them as an input schema.
        def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
            return np.asarray(model_input, dtype=np.float64) * self.scale

    mlflow_client.set_experiment("server-tests")
    for scale in (2.0, 10.0):
        with mlflow_client.start_run():
            pyfunc.log_model(name="model", python_model=Affine(scale), registered_model_name="affine")
    registry = MlflowClient()
    registry.set_registered_model_alias("affine", "champion", "1")

    env = {"MLFLOW_TRACKING_URI": tracking_uri, **s3.env()}
    config = write_config(
        tmp_path / "server.json", modelName="affine", handler="mlflow-pyfunc",
        modelDir=str(tmp_path / "cache"), storageUri="models:/affine@champion",
    )
    record, _ = fetch(config, env)
    assert record["version"] == "1"
    assert record["details"]["alias"] == "champion"
    marker = json.loads((tmp_path / "cache" / MARKER).read_text())
    assert marker["version"] == "1"

    with model_server(config, tmp_path / "server.log", env) as url:
        metadata = httpx.get(f"{url}/v2/models/affine", timeout=10).json()
        assert metadata["versions"] == ["1"]
        response = httpx.post(
            f"{url}/v2/models/affine/infer",
            json={"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP64", "data": [1, 2, 3, 4]}]},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
        assert httpx.get(f"{url}/v2/models/affine/versions/2/ready", timeout=10).status_code == 404

    # Moving the alias moves what a fresh fetch serves (in-process here: the command was shown above).
    registry.set_registered_model_alias("affine", "champion", "2")
    moved = fetch_model(ServerConfig.from_file(config))
    assert moved is not None and moved.version == "2"
    latest = ServerConfig(
        model_name="affine", handler="mlflow-pyfunc", model_dir=str(tmp_path / "cache-latest"),
        storage_uri="models:/affine/latest",
    )
    newest = fetch_model(latest)
    assert newest is not None and newest.version == "2"
