"""The example data set: hourly driver statistics and a labelled entity dataframe, generated, not downloaded.

``python -m loom.workloads.features.example_data --out DIR [--end 2026-01-03T00:00:00Z|now]`` writes

- ``driver_stats.parquet``: for drivers 1001-1005, one row per hour over ``--hours`` hours ending at
  ``--end``: ``driver_id`` (int64), ``conv_rate`` / ``acc_rate`` (float32), ``avg_daily_trips`` (int64),
  ``event_timestamp`` and ``created`` (UTC). Driver 1001's newest hour appears twice with one event time;
  the row created later holds ``conv_rate`` 0.999, so dedup by the created column is observable.
- ``driver_entities.parquet``: entity rows (``driver_id``, ``event_timestamp``, ``trip_completed`` label)
  at half past each hour, the input of a point-in-time training set.

The same ``--end`` and ``--seed`` give the same values (a NumPy generator seeded explicitly); ``--end now``
(rounded down to the hour) makes data fresh enough for ttl-bound online serving in a live demo.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd

DRIVERS: tuple[int, ...] = (1001, 1002, 1003, 1004, 1005)
DEFAULT_END = datetime(2026, 1, 3, tzinfo=UTC)
DEDUP_CONV_RATE = np.float32(0.999)


def parse_end(text: str) -> datetime:
    if text == "now":
        return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def driver_stats(end: datetime = DEFAULT_END, hours: int = 48, seed: int = 7) -> pd.DataFrame:
    """Hourly rows ``end - (hours-1)h .. end`` for every driver, plus the dedup row described above."""
    rng = np.random.default_rng(seed)
    times = [end - timedelta(hours=h) for h in range(hours - 1, -1, -1)]
    rows = []
    for driver in DRIVERS:
        for when in times:
            rows.append({
                "driver_id": driver,
                "conv_rate": np.float32(round(float(rng.uniform(0.1, 0.9)), 4)),
                "acc_rate": np.float32(round(float(rng.uniform(0.5, 1.0)), 4)),
                "avg_daily_trips": int(rng.integers(5, 50)),
                "event_timestamp": when,
                "created": when + timedelta(minutes=1),
            })
    newest = times[-1]  # driver 1001's newest hour, rewritten a minute later with another conv_rate
    late = {**rows[len(times) - 1], "conv_rate": DEDUP_CONV_RATE, "created": newest + timedelta(minutes=2)}
    rows.append(late)
    frame = pd.DataFrame(rows)
    frame["driver_id"] = frame["driver_id"].astype("int64")
    frame["avg_daily_trips"] = frame["avg_daily_trips"].astype("int64")
    for column in ("event_timestamp", "created"):
        frame[column] = pd.to_datetime(frame[column], utc=True)
    return frame


def entity_rows(end: datetime = DEFAULT_END, hours: int = 48, seed: int = 11) -> pd.DataFrame:
    """Entity dataframe for training: every driver at half past each hour, with a binary label."""
    rng = np.random.default_rng(seed)
    rows = [
        {
            "driver_id": driver,
            "event_timestamp": end - timedelta(hours=h) + timedelta(minutes=30),
            "trip_completed": int(rng.integers(0, 2)),
        }
        for driver in DRIVERS
        for h in range(hours - 1, 0, -1)
    ]
    frame = pd.DataFrame(rows)
    frame["driver_id"] = frame["driver_id"].astype("int64")
    frame["event_timestamp"] = pd.to_datetime(frame["event_timestamp"], utc=True)
    return frame


def write(out: Path, end: datetime = DEFAULT_END, hours: int = 48) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"driverStats": out / "driver_stats.parquet", "entities": out / "driver_entities.parquet"}
    driver_stats(end, hours).to_parquet(paths["driverStats"], index=False)
    entity_rows(end, hours).to_parquet(paths["entities"], index=False)
    return {name: str(path) for name, path in paths.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--end", default=DEFAULT_END.isoformat(), help="newest event time (ISO 8601 or 'now')")
    parser.add_argument("--hours", type=int, default=48)
    args = parser.parse_args(argv)
    print(json.dumps(write(args.out, parse_end(args.end), args.hours)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
