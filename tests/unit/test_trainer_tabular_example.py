"""The bundled tabular example (workloads/trainer/examples/driver_conversion.py): its loader reads a point-in-time
training set as `historical` writes it, and its batches are a pure function of their position."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from loom.workloads.features import example_data
from loom.workloads.trainer.examples import driver_conversion
from loom.workloads.trainer.task import TaskContext


def training_set(path: Path) -> Path:
    """What `historical` writes: the entity rows with the features joined, nulls where nothing was in range."""
    entities = example_data.entity_rows(hours=6)
    frame = entities.assign(conv_rate=0.5, acc_rate=0.75, avg_daily_trips=10)
    frame["conv_rate"] = frame["conv_rate"].astype("float32") + frame.index.to_series().astype("float32") / 100
    frame.loc[frame.index[:3], ["conv_rate", "acc_rate", "avg_daily_trips"]] = None
    frame.to_parquet(path, index=False)
    return path


def context(data: Path, **args: object) -> TaskContext:
    return TaskContext(rank=0, world_size=1, local_rank=0, device="cpu", seed=5, batch_size=8,
                       args={"data": str(data), **args})  # fmt: skip


def test_loader_drops_rows_without_features_and_model_standardises(tmp_path: Path) -> None:
    data = training_set(tmp_path / "train.parquet")
    task = driver_conversion.task
    ctx = context(data)
    source = task.build_data(ctx)
    rows = len(pd.read_parquet(data))
    assert len(source.y) == rows - 3
    assert set(source.y.tolist()) <= {0.0, 1.0}
    model = task.build_model(ctx)
    scaled = model[0](source.x)
    assert torch.allclose(scaled.mean(dim=0)[:1], torch.zeros(1), atol=1e-5)
    loss = task.loss(model, source.batch(0, 0, 1, 8))
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_batches_are_a_pure_function_of_their_position(tmp_path: Path) -> None:
    source = driver_conversion.task.build_data(context(training_set(tmp_path / "train.parquet")))
    a, b = source.batch(3, 0, 2, 8), source.batch(3, 0, 2, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(source.batch(3, 1, 2, 8)[0], a[0])


def test_logistic_regression_variant_and_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = training_set(tmp_path / "train.parquet")
    model = driver_conversion.task.build_model(context(data, hidden=0))
    assert [type(m).__name__ for m in model] == ["Standardize", "Linear"]
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['speed'\]"):
        driver_conversion.task.build_data(context(data, features="conv_rate,speed"))
    monkeypatch.delenv(driver_conversion.DATA_ENV, raising=False)
    empty = TaskContext(rank=0, world_size=1, local_rank=0, device="cpu", seed=5, batch_size=8, args={})
    with pytest.raises(ValueError, match="LOOM_TRAINING_DATA"):
        driver_conversion.task.build_data(empty)
