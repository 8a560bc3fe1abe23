"""Builders for tests and the demo: the example driver_stats view and a single-node store in one folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.workloads.features.config import FeaturesConfig


def driver_view(source: str, ttl_seconds: int = 7200, **overrides: Any) -> dict[str, Any]:
    """The example FeatureView (camelCase contract) over ``example_data.driver_stats``."""
    view: dict[str, Any] = {
        "name": "driver_stats",
        "entities": [{"name": "driver", "joinKeys": ["driver_id"], "valueType": "Int64"}],
        "features": [
            {"name": "conv_rate", "dtype": "Float32"},
            {"name": "acc_rate", "dtype": "Float32"},
            {"name": "avg_daily_trips", "dtype": "Int64"},
        ],
        "source": {"path": source, "timestampField": "event_timestamp", "createdTimestampField": "created"},
        "ttlSeconds": ttl_seconds,
        "description": "hourly driver statistics",
        "tags": {"team": "rides"},
    }
    view.update(overrides)
    return view


def local_config(root: Path, views: list[dict[str, Any]], project: str = "demo", **overrides: Any) -> FeaturesConfig:
    """Registry file, sqlite online store and Feast's repo folder, all under ``root``."""
    document: dict[str, Any] = {
        "project": project,
        "featureViews": views,
        "registry": {"path": str(root / "registry.db")},
        "onlineStore": {"path": str(root / "online.db")},
        "repoPath": str(root / "repo"),
    }
    document.update(overrides)
    return FeaturesConfig.model_validate(document)
