"""The real backing services start, answer, and carry data end to end (S3 objects, MLflow runs/artifacts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.devstack.servers import MLflowEndpoint, S3Endpoint


def test_s3_server_stores_and_returns_objects(s3: S3Endpoint) -> None:
    client = s3.client()
    client.create_bucket(Bucket="services-smoke")
    client.put_object(Bucket="services-smoke", Key="a/b.txt", Body=b"hello")
    assert client.get_object(Bucket="services-smoke", Key="a/b.txt")["Body"].read() == b"hello"


@pytest.mark.slow  # an MLflow server takes tens of seconds to start
def test_mlflow_server_records_runs_and_stores_artifacts_in_s3(
    mlflow: MLflowEndpoint, s3: S3Endpoint, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow.url)
    experiment_id = client.create_experiment("services-smoke")
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    artifact = tmp_path / "note.txt"
    artifact.write_text("kept")
    client.log_artifact(run.info.run_id, str(artifact))

    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(3, 1.5)]
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket="mlflow").get("Contents", [])]
    assert any(key.endswith("/note.txt") for key in keys), keys
