"""The Feast workload's commands against the real Feast SDK: file registry, sqlite online store and the file
offline store in a temporary folder. Apply, delete, materialize (window and incremental), online reads, and
point-in-time historical retrieval."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from feast import FeatureStore
from feast.errors import FeatureViewNotFoundException

from loom.workloads.features import commands, example_data
from loom.workloads.features.config import FeaturesConfig, NotFound
from loom.workloads.features.testing import driver_view, local_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

END = example_data.DEFAULT_END
FEATURES = ["driver_stats:conv_rate", "driver_stats:acc_rate", "driver_stats:avg_daily_trips"]


def write_stats(path: Path, frame: pd.DataFrame) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return str(path)


def online(store: FeatureStore, drivers: list[int], features: list[str] = FEATURES) -> dict[str, list[Any]]:
    return dict(store.get_online_features(features=features, entity_rows=[{"driver_id": d} for d in drivers]).to_dict())


def newest_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Per driver, the newest event's row; of rows sharing that event time, the one created last."""
    ordered = frame.sort_values(["driver_id", "event_timestamp", "created"])
    return ordered.groupby("driver_id").tail(1).set_index("driver_id")


@pytest.fixture
def stats(tmp_path: Path) -> pd.DataFrame:
    return example_data.driver_stats(END, hours=48)


@pytest.fixture
def applied(tmp_path: Path, stats: pd.DataFrame) -> tuple[FeaturesConfig, FeatureStore]:
    source = write_stats(tmp_path / "data" / "driver_stats.parquet", stats)
    config = local_config(tmp_path / "store", [driver_view(source)])
    store = commands.open_store(config)
    assert commands.apply(store, config)["outcome"] == "Applied"
    return config, store


def test_apply_registers_what_the_contract_says_and_a_second_apply_changes_nothing(tmp_path: Path) -> None:
    source = write_stats(tmp_path / "driver_stats.parquet", example_data.driver_stats(END, hours=3))
    config = local_config(tmp_path / "store", [driver_view(source)])
    store = commands.open_store(config)

    first = commands.apply(store, config)
    assert first["outcome"] == "Applied"
    assert first["featureViews"] == [
        {"name": "driver_stats", "changed": True, "changes": ["entity driver: created", "created"]}
    ]
    registered = store.get_feature_view("driver_stats")
    assert registered.ttl == timedelta(hours=2)
    assert registered.online is True
    assert registered.description == "hourly driver statistics"
    assert registered.tags["team"] == "rides"
    assert registered.batch_source.created_timestamp_column == "created"
    assert [(f.name, str(f.dtype)) for f in registered.features] == [
        ("conv_rate", "Float32"), ("acc_rate", "Float32"), ("avg_daily_trips", "Int64")
    ]
    assert store.get_entity("driver").join_key == "driver_id"

    registry_bytes = Path(config.registry.path or "").read_bytes()
    second = commands.apply(store, config)
    assert second["outcome"] == "Unchanged"
    assert second["featureViews"] == [{"name": "driver_stats", "changed": False, "changes": []}]
    # Not even a new last-updated time: the registry file is byte for byte what the first apply wrote.
    assert Path(config.registry.path or "").read_bytes() == registry_bytes

    shorter = local_config(tmp_path / "store", [driver_view(source, ttl_seconds=600)])
    third = commands.apply(commands.open_store(shorter), shorter)
    assert third["outcome"] == "Applied"
    assert third["featureViews"][0]["changes"] == ["ttl"]
    assert store.get_feature_view("driver_stats").ttl == timedelta(minutes=10)


def test_materialized_window_serves_the_newest_value_within_ttl_and_nothing_outside_it(tmp_path: Path) -> None:
    stats = example_data.driver_stats(END, hours=48)
    # Driver 1005 stopped reporting five hours before the end: outside the two-hour ttl.
    stats = stats[~((stats.driver_id == 1005) & (stats.event_timestamp > END - timedelta(hours=5)))]
    source = write_stats(tmp_path / "driver_stats.parquet", stats)
    config = local_config(tmp_path / "store", [driver_view(source, ttl_seconds=7200)])
    store = commands.open_store(config)
    commands.apply(store, config)

    end = END + timedelta(minutes=1)
    result = commands.materialize(store, config, start=END - timedelta(hours=48), end=end)
    assert result["outcome"] == "Succeeded" and result["mode"] == "window"
    # The requested two days are cut to the ttl: older values must never reach the online store.
    assert result["requestedStart"] == (END - timedelta(hours=48)).isoformat()
    assert result["window"] == {"start": (end - timedelta(hours=2)).isoformat(), "end": end.isoformat()}
    assert result["rowsWritten"] == 4
    assert result["featureViews"][0]["rowsWritten"] == 4

    values = online(store, [1001, 1002, 1003, 1004, 1005, 9999])
    expected = newest_rows(stats)
    for index, driver in enumerate([1002, 1003, 1004]):
        row = expected.loc[driver]
        assert values["conv_rate"][index + 1] == pytest.approx(float(row.conv_rate))
        assert values["avg_daily_trips"][index + 1] == int(row.avg_daily_trips)
    # Two rows share driver 1001's newest event time; the one created later wins.
    assert values["conv_rate"][0] == pytest.approx(float(example_data.DEDUP_CONV_RATE))
    assert values["conv_rate"][4] is None and values["acc_rate"][4] is None  # only values older than ttl
    assert values["conv_rate"][5] is None  # an unknown entity


def test_incremental_materialization_resumes_where_the_last_run_ended(tmp_path: Path) -> None:
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    first_end_of_data = now - timedelta(hours=1)
    stats = example_data.driver_stats(first_end_of_data, hours=6)
    path = tmp_path / "driver_stats.parquet"
    source = write_stats(path, stats)
    config = local_config(tmp_path / "store", [driver_view(source, ttl_seconds=3 * 3600)])
    store = commands.open_store(config)
    commands.apply(store, config)

    first_end = now - timedelta(minutes=30)
    first = commands.materialize(store, config, end=first_end)
    assert first["mode"] == "incremental"
    assert first["window"]["end"] == first_end.isoformat()
    assert first["rowsWritten"] == 5
    assert online(store, [1003])["conv_rate"] == [pytest.approx(float(newest_rows(stats).loc[1003].conv_rate))]

    # An hour later two drivers report again.
    fresh = pd.DataFrame({
        "driver_id": np.array([1001, 1002], dtype="int64"),
        "conv_rate": np.array([0.11, 0.22], dtype="float32"),
        "acc_rate": np.array([0.5, 0.5], dtype="float32"),
        "avg_daily_trips": np.array([7, 8], dtype="int64"),
        "event_timestamp": pd.to_datetime([now, now], utc=True),
        "created": pd.to_datetime([now, now], utc=True),
    })
    write_stats(path, pd.concat([stats, fresh], ignore_index=True))
    second_end = now + timedelta(minutes=1)
    second = commands.materialize(store, config, end=second_end)
    assert second["window"] == {"start": first_end.isoformat(), "end": second_end.isoformat()}
    assert second["rowsWritten"] == 2
    values = online(store, [1001, 1002, 1003])
    assert values["conv_rate"][:2] == [pytest.approx(0.11), pytest.approx(0.22)]
    assert values["conv_rate"][2] == pytest.approx(float(newest_rows(stats).loc[1003].conv_rate))


def test_historical_retrieval_is_point_in_time_correct(tmp_path: Path, applied: tuple[FeaturesConfig, FeatureStore],
                                                       stats: pd.DataFrame) -> None:
    config, store = applied
    entities = example_data.entity_rows(END, hours=48)
    extra = pd.DataFrame({
        "driver_id": np.array([1001, 1001, 1002], dtype="int64"),
        "event_timestamp": pd.to_datetime([END - timedelta(minutes=30),  # the 0.999 row is 30 minutes later
                                           END - timedelta(hours=100),    # before any data
                                           END + timedelta(hours=5)],     # newest data is older than the ttl
                                          utc=True),
        "trip_completed": [1, 0, 1],
    })
    entities = pd.concat([entities, extra], ignore_index=True)
    entity_path = tmp_path / "entities.parquet"
    entities.to_parquet(entity_path, index=False)

    output = tmp_path / "out" / "training.parquet"
    result = commands.historical(store, config, str(entity_path), str(output))
    assert result["outcome"] == "Succeeded"
    # Every entity row survives (Feast's file store alone drops the ones without features, see
    # commands.keep_every_entity_row), in the entity dataframe's order.
    assert result["rows"] == len(entities)
    assert result["rowsWithoutFeatures"] == 2
    training = pd.read_parquet(output)
    assert training["trip_completed"].tolist() == entities["trip_completed"].tolist()
    assert {"driver_id", "event_timestamp", "trip_completed", "conv_rate", "acc_rate", "avg_daily_trips"} <= set(
        training.columns
    )

    # Reference join computed independently: newest row at or before each entity row, within the ttl,
    # ties on event time broken by the created column.
    deduped = stats.sort_values("created").drop_duplicates(["driver_id", "event_timestamp"], keep="last")
    expected = pd.merge_asof(
        entities.sort_values("event_timestamp"), deduped.sort_values("event_timestamp"),
        on="event_timestamp", by="driver_id", direction="backward", tolerance=pd.Timedelta(hours=2),
    )
    key = ["driver_id", "event_timestamp"]
    merged = training.merge(expected.drop_duplicates(key), on=key, suffixes=("", "_expected"))
    assert len(merged) == len(entities)
    np.testing.assert_allclose(merged["conv_rate"].astype(float), merged["conv_rate_expected"].astype(float))

    by_key = training.drop_duplicates(key).set_index(key)
    row_before = stats[(stats.driver_id == 1001) & (stats.event_timestamp == END - timedelta(hours=1))]
    value = by_key.loc[(1001, END - timedelta(minutes=30)), "conv_rate"]
    assert value == pytest.approx(float(row_before.conv_rate.iloc[0]))
    assert value != pytest.approx(float(example_data.DEDUP_CONV_RATE))  # the future value is never joined
    assert pd.isna(by_key.loc[(1001, END - timedelta(hours=100)), "conv_rate"])
    assert pd.isna(by_key.loc[(1002, END + timedelta(hours=5)), "conv_rate"])


def test_delete_removes_the_view_its_online_table_and_entities_no_view_uses(
    tmp_path: Path, stats: pd.DataFrame
) -> None:
    source = write_stats(tmp_path / "driver_stats.parquet", stats)
    trips = driver_view(source, name="driver_trips", features=[{"name": "avg_daily_trips", "dtype": "Int64"}])
    config = local_config(tmp_path / "store", [driver_view(source), trips])
    store = commands.open_store(config)
    commands.apply(store, config)
    commands.materialize(store, config, start=END - timedelta(hours=1), end=END + timedelta(minutes=1))
    online_db = config.online_store.path

    def tables() -> set[str]:
        with sqlite3.connect(online_db) as connection:
            return {row[0] for row in connection.execute("select name from sqlite_master where type='table'")}

    assert {"demo_driver_stats", "demo_driver_trips"} <= tables()
    result = commands.delete(store, config, ["driver_stats"])
    assert result == {"command": "delete", "outcome": "Deleted", "project": "demo", "deleted": ["driver_stats"],
                      "absent": [], "entitiesDeleted": []}  # driver_trips still uses the entity
    with pytest.raises(FeatureViewNotFoundException):
        store.get_feature_view("driver_stats")
    assert "demo_driver_stats" not in tables()
    assert online(store, [1002], ["driver_trips:avg_daily_trips"])["avg_daily_trips"] == [
        int(newest_rows(stats).loc[1002].avg_daily_trips)
    ]

    last = commands.delete(store, config, ["driver_trips"])
    assert last["entitiesDeleted"] == ["driver"]
    assert store.list_feature_views() == [] and store.list_entities() == []
    assert commands.delete(store, config, ["driver_trips"])["outcome"] == "Absent"


def test_materializing_a_view_that_was_never_applied_says_so(tmp_path: Path, stats: pd.DataFrame) -> None:
    source = write_stats(tmp_path / "driver_stats.parquet", stats)
    config = local_config(tmp_path / "store", [driver_view(source)])
    with pytest.raises(NotFound, match="'driver_stats' is not registered in project 'demo'"):
        commands.materialize(commands.open_store(config), config)


def test_sql_registry_from_an_environment_variable(
    tmp_path: Path, stats: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Feast's SQL registry (PostgreSQL/MySQL in production) through SQLAlchemy; sqlite stands in here.
    monkeypatch.setenv("FEAST_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.sqlite'}")
    source = write_stats(tmp_path / "driver_stats.parquet", stats)
    config = local_config(tmp_path / "store", [driver_view(source)],
                          registry={"type": "sql", "urlEnv": "FEAST_REGISTRY_URL"})
    assert config.registry.location == "sql (${FEAST_REGISTRY_URL})"
    assert commands.apply(commands.open_store(config), config)["outcome"] == "Applied"
    other_pod = commands.open_store(config)
    assert commands.apply(other_pod, config)["outcome"] == "Unchanged"
    assert other_pod.get_feature_view("driver_stats").ttl == timedelta(hours=2)
