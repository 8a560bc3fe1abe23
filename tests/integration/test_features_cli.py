"""`python -m loom.workloads.features` as the operator runs it: JSON results, exit codes, termination messages,
and Feast's feature server answering its real HTTP API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loom.workloads.features import example_data
from loom.workloads.features.__main__ import main
from loom.workloads.features.config import (
    EXIT_INVALID_CONFIG,
    EXIT_INVALID_SOURCE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    FEATURE_DTYPES,
    SCALAR_DTYPES,
)
from loom.workloads.features.testing import driver_view, local_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_config(tmp_path: Path, views: list[dict[str, Any]], **overrides: Any) -> Path:
    config = local_config(tmp_path / "store", views, **overrides)
    path = tmp_path / "features.json"
    path.write_text(config.to_json())
    return path


def run_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any], str]:
    """(exit code, termination message, stderr); stdout's last line must be the JSON result on success."""
    termination = tmp_path / "termination-log"
    termination.unlink(missing_ok=True)
    code = main([*argv, "--termination-log", str(termination)])
    out, err = capsys.readouterr()
    message = json.loads(termination.read_text())
    if code == EXIT_OK:
        assert json.loads(out.strip().splitlines()[-1]) == {k: v for k, v in message.items() if k != "exitCode"}
    return code, message, err


@pytest.fixture
def source(tmp_path: Path) -> str:
    path = tmp_path / "data" / "driver_stats.parquet"
    path.parent.mkdir()
    example_data.driver_stats(example_data.DEFAULT_END, hours=6).to_parquet(path, index=False)
    return str(path)


def test_apply_materialize_historical_through_the_cli(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, source: str
) -> None:
    config = str(write_config(tmp_path, [driver_view(source)]))
    code, message, _ = run_cli(capsys, tmp_path, "apply", "--config", config)
    assert (code, message["exitCode"], message["outcome"]) == (0, 0, "Applied")
    assert message["registry"] == str(tmp_path / "store" / "registry.db")

    end = example_data.DEFAULT_END + timedelta(minutes=1)
    code, message, _ = run_cli(capsys, tmp_path, "materialize", "--config", config,
                               "--start", "2026-01-02T00:00:00Z", "--end", end.isoformat())
    assert code == 0
    assert message["window"] == {"start": (end - timedelta(hours=2)).isoformat(), "end": end.isoformat()}
    assert message["rowsWritten"] == 5

    entities = tmp_path / "entities.parquet"
    example_data.entity_rows(example_data.DEFAULT_END, hours=6).to_parquet(entities)
    output = tmp_path / "train.parquet"
    result = tmp_path / "result.json"
    code, message, _ = run_cli(capsys, tmp_path, "historical", "--config", config, "--entities", str(entities),
                               "--output", str(output), "--result", str(result))
    assert code == 0 and message["rows"] == 25 and message["rowsWithoutFeatures"] == 0
    assert json.loads(result.read_text())["output"] == str(output)
    assert pq.read_table(output).num_rows == 25


def test_missing_timestamp_column_is_an_invalid_source_with_the_column_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, source: str
) -> None:
    view = driver_view(source)
    view["source"]["timestampField"] = "ts"
    config = str(write_config(tmp_path, [view]))
    code, message, err = run_cli(capsys, tmp_path, "apply", "--config", config)
    assert code == EXIT_INVALID_SOURCE
    assert message["reason"] == "InvalidSource"
    assert f"source {source} has no column 'ts' (timestamp field)" in message["message"]
    assert "its columns are acc_rate, avg_daily_trips, conv_rate, created, driver_id, event_timestamp" in err
    assert not (tmp_path / "store" / "registry.db").exists() or "driver_stats" not in (
        tmp_path / "store" / "registry.db"
    ).read_bytes().decode("latin-1")


def test_unreadable_source_carries_the_readers_own_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"this is not parquet")
    config = str(write_config(tmp_path, [driver_view(str(broken))]))
    code, message, err = run_cli(capsys, tmp_path, "apply", "--config", config)
    assert code == EXIT_INVALID_SOURCE
    assert message["message"].startswith(f"feature view 'driver_stats': cannot read source {broken}: ")
    # pyarrow's words, as Feast surfaces them.
    assert "Parquet magic bytes not found" in message["message"]
    assert "InvalidSource" in err

    missing = str(tmp_path / "nowhere.parquet")
    config = str(write_config(tmp_path, [driver_view(missing)]))
    code, message, _ = run_cli(capsys, tmp_path, "apply", "--config", config)
    assert code == EXIT_INVALID_SOURCE and "nowhere.parquet" in message["message"]


def test_invalid_config_and_unknown_views_have_their_own_exit_codes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, source: str
) -> None:
    config_path = write_config(tmp_path, [driver_view(source)])
    document = json.loads(config_path.read_text())
    document["featureViews"][0]["features"][0]["dtype"] = "Float16"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(document))
    code, message, _ = run_cli(capsys, tmp_path, "apply", "--config", str(bad))
    assert code == EXIT_INVALID_CONFIG and message["reason"] == "InvalidConfig"
    assert "feature view 'driver_stats' feature 'conv_rate': unknown dtype 'Float16'" in message["message"]

    code, message, _ = run_cli(capsys, tmp_path, "materialize", "--config", str(config_path), "--view", "nope")
    assert code == EXIT_NOT_FOUND and "nope" in message["message"]

    code, message, _ = run_cli(capsys, tmp_path, "delete", "--config", str(config_path), "--view", "driver_stats")
    assert code == EXIT_OK and message["outcome"] == "Absent"


def test_every_supported_dtype_round_trips_through_the_online_and_offline_stores(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    when = datetime(2026, 1, 1, 12, tzinfo=UTC)
    stamp = pa.timestamp("us", tz="UTC")
    arrow_types = {"Int32": pa.int32(), "Int64": pa.int64(), "Float32": pa.float32(), "Float64": pa.float64(),
                   "String": pa.string(), "Bool": pa.bool_(), "Bytes": pa.binary(), "UnixTimestamp": stamp}
    samples: dict[str, Any] = {"Int32": -7, "Int64": 2**40, "Float32": 0.5, "Float64": 0.25, "String": "ü",
                               "Bool": True, "Bytes": b"\x00\xff", "UnixTimestamp": when - timedelta(hours=1)}
    columns: dict[str, pa.Array] = {"k": pa.array([1], pa.int64()), "event_timestamp": pa.array([when], stamp)}
    for name in SCALAR_DTYPES:
        columns[f"s_{name.lower()}"] = pa.array([samples[name]], arrow_types[name])
        columns[f"a_{name.lower()}"] = pa.array([[samples[name], samples[name]]], pa.list_(arrow_types[name]))
    source = tmp_path / "all_types.parquet"
    pq.write_table(pa.table(columns), source)
    features = [{"name": f"{'a' if d.startswith('Array') else 's'}_{d.removeprefix('Array(').rstrip(')').lower()}",
                 "dtype": d} for d in FEATURE_DTYPES]
    view = {"name": "all_types", "entities": [{"name": "k"}], "features": features,
            "source": {"path": str(source)}, "ttlSeconds": 7200}
    config = str(write_config(tmp_path, [view]))
    assert run_cli(capsys, tmp_path, "apply", "--config", config)[0] == 0
    code, message, _ = run_cli(capsys, tmp_path, "materialize", "--config", config,
                               "--start", (when - timedelta(hours=1)).isoformat(),
                               "--end", (when + timedelta(minutes=1)).isoformat())
    assert (code, message["rowsWritten"]) == (0, 1)

    from loom.workloads.features.commands import open_store
    from loom.workloads.features.config import FeaturesConfig

    store = open_store(FeaturesConfig.from_file(config))
    values = store.get_online_features(
        features=[f"all_types:{f['name']}" for f in features], entity_rows=[{"k": 1}]
    ).to_dict()
    for name in SCALAR_DTYPES:
        expected = samples[name]
        scalar, array = values[f"s_{name.lower()}"][0], values[f"a_{name.lower()}"][0]
        if isinstance(expected, float):
            assert scalar == pytest.approx(expected) and array == pytest.approx([expected, expected])
        else:
            assert (scalar, array) == (expected, [expected, expected]), name


@pytest.fixture
def feature_server(tmp_path: Path, source: str) -> Iterator[tuple[str, str]]:
    """`serve` as a real process (gunicorn under Feast), after apply and materialize through the CLI."""
    port, metrics_port = free_port(), free_port()
    config = write_config(tmp_path, [driver_view(source)],
                          serve={"host": "127.0.0.1", "port": port, "metricsPort": metrics_port})
    env = {**os.environ, "PYTHONSAFEPATH": "1", "LOOM_TERMINATION_LOG": str(tmp_path / "serve-termination")}
    module = [sys.executable, "-m", "loom.workloads.features"]
    end = (example_data.DEFAULT_END + timedelta(minutes=1)).isoformat()
    for argv in (["apply"], ["materialize", "--start", "2026-01-02T00:00:00Z", "--end", end]):
        done = subprocess.run([*module, *argv, "--config", str(config)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen([*module, "serve", "--config", str(config)], env=env, stdout=log, stderr=log,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("feature server never became healthy:\n" + (tmp_path / "serve.log").read_text())
        yield url, f"http://127.0.0.1:{metrics_port}"
    finally:
        os.killpg(process.pid, 15)
        process.wait(timeout=30)
        log.close()


def test_feature_server_answers_feasts_http_api(feature_server: tuple[str, str]) -> None:
    url, metrics_url = feature_server
    response = httpx.post(f"{url}/get-online-features", json={
        "features": ["driver_stats:conv_rate", "driver_stats:avg_daily_trips"],
        "entities": {"driver_id": [1001, 1002, 4242]},
    }, timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    names = body["metadata"]["feature_names"]
    assert sorted(names) == ["avg_daily_trips", "conv_rate", "driver_id"]
    conv_rate = body["results"][names.index("conv_rate")]
    assert conv_rate["values"][0] == pytest.approx(float(example_data.DEDUP_CONV_RATE))
    assert conv_rate["statuses"] == ["PRESENT", "PRESENT", "NOT_FOUND"]
    assert conv_rate["values"][2] is None

    deadline = time.monotonic() + 30
    while True:
        try:
            metrics = httpx.get(metrics_url, timeout=5).text
            if "feast_feature_server_request" in metrics:
                break
        except httpx.HTTPError:
            metrics = ""
        assert time.monotonic() < deadline, metrics[-2000:]
        time.sleep(1)
