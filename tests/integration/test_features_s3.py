"""A Feast project whose registry, source, entity dataframe and training set all live in a real S3 server
(the session's moto server), reached only through the endpoints in the config and AWS_* credentials."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from loom.workloads.features import commands, example_data
from loom.workloads.features.config import FeaturesConfig
from loom.workloads.features.testing import driver_view

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def upload(client: Any, bucket: str, key: str, frame: pd.DataFrame) -> str:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    client.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())
    return f"s3://{bucket}/{key}"


def test_s3_registry_and_source(s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Credentials as a pod gets them from a Secret; no endpoint variables: the config must carry them.
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FEAST_S3_ENDPOINT_URL"):
        monkeypatch.setenv(name, "unset")  # recorded, so whatever open_store sets is undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3.region)
    client = s3.client()

    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    stats = example_data.driver_stats(end, hours=6)
    source = upload(client, bucket, "sources/driver_stats.parquet", stats)
    entities = upload(client, bucket, "training/entities.parquet", example_data.entity_rows(end, hours=6))
    view = driver_view(source, ttl_seconds=3 * 3600)
    view["source"]["endpoint"] = s3.url
    config = FeaturesConfig.model_validate({
        "project": "s3demo",
        "featureViews": [view],
        "registry": {"path": f"s3://{bucket}/feast/registry.db", "endpoint": s3.url},
        "onlineStore": {"path": str(tmp_path / "online.db")},
        "repoPath": str(tmp_path / "repo"),
    })
    store = commands.open_store(config)

    assert commands.apply(store, config)["outcome"] == "Applied"
    assert commands.apply(commands.open_store(config), config)["outcome"] == "Unchanged"
    keys = {item["Key"] for item in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert "feast/registry.db" in keys

    # A second pod (a fresh store from the same config) sees what the first registered.
    reader = commands.open_store(config)
    assert reader.get_feature_view("driver_stats").batch_source.path == source

    result = commands.materialize(reader, config, end=end + timedelta(minutes=1))
    assert result["rowsWritten"] == 5
    values = reader.get_online_features(features=["driver_stats:conv_rate"], entity_rows=[{"driver_id": 1001}])
    assert values.to_dict()["conv_rate"] == [pytest.approx(float(example_data.DEDUP_CONV_RATE))]

    output = f"s3://{bucket}/training/train.parquet"
    history = commands.historical(reader, config, entities, output)
    assert history["rows"] == 25 and history["rowsWithoutFeatures"] == 0
    body = client.get_object(Bucket=bucket, Key="training/train.parquet")["Body"].read()
    training = pd.read_parquet(io.BytesIO(body))
    assert len(training) == 25 and training["conv_rate"].notna().all()

    missing = FeaturesConfig.model_validate({
        **config.model_dump(by_alias=True),
        "featureViews": [{**view, "source": {**view["source"], "path": f"s3://{bucket}/sources/nope.parquet"}}],
    })
    with pytest.raises(commands.InvalidSource, match=r"cannot read source s3://.*/sources/nope.parquet"):
        commands.apply(commands.open_store(missing), missing)
