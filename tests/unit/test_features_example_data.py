"""The shipped example data set is generated, deterministic, and has the shape the examples rely on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd

from loom.workloads.features import example_data


def test_same_end_gives_the_same_data(tmp_path: Path) -> None:
    first = example_data.write(tmp_path / "a")
    second = example_data.write(tmp_path / "b")
    for name in first:
        pd.testing.assert_frame_equal(pd.read_parquet(first[name]), pd.read_parquet(second[name]))


def test_driver_stats_shape_and_the_dedup_row() -> None:
    end = datetime(2026, 3, 1, 12, tzinfo=UTC)
    frame = example_data.driver_stats(end, hours=6)
    assert len(frame) == 5 * 6 + 1
    assert str(frame["driver_id"].dtype) == "int64" and str(frame["conv_rate"].dtype) == "float32"
    assert frame["event_timestamp"].max() == end
    assert frame["event_timestamp"].min() == end - timedelta(hours=5)
    newest = frame[(frame.driver_id == 1001) & (frame.event_timestamp == end)].sort_values("created")
    assert len(newest) == 2
    assert newest.iloc[-1]["conv_rate"] == example_data.DEDUP_CONV_RATE != newest.iloc[0]["conv_rate"]


def test_entity_rows_fall_between_feature_rows() -> None:
    end = datetime(2026, 3, 1, 12, tzinfo=UTC)
    rows = example_data.entity_rows(end, hours=6)
    assert len(rows) == 5 * 5
    assert set(rows["event_timestamp"].dt.minute) == {30}
    assert set(rows["trip_completed"]) <= {0, 1}


def test_cli_writes_both_files(tmp_path: Path) -> None:
    assert example_data.main(["--out", str(tmp_path), "--end", "2026-01-01T00:00:00Z", "--hours", "3"]) == 0
    assert len(pd.read_parquet(tmp_path / "driver_stats.parquet")) == 16
    assert example_data.parse_end("now").minute == 0
