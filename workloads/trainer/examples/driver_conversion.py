"""Bundled tabular example: will a trip be completed, from a driver's point-in-time features (CPU, seconds).

Trains a small MLP (a logistic regression with `hidden=0`) on the training set a TrainingJob's `trainingData`
built with Feast's historical retrieval from the FeatureView `driver-stats` (examples/): one row per entity row,
its label `trip_completed` and the features `conv_rate`, `acc_rate`, `avg_daily_trips` as they were at the
row's timestamp. The loader reads that parquet from where the operator says it is (LOOM_TRAINING_DATA, an
s3:// URI, with LOOM_TRAINING_DATA_ENDPOINT and the AWS_* keys), or from `taskArgs.data` (a path or s3:// URI).

Rows that found no feature value within the view's ttl (all features null) are dropped; the features are
standardised with the training set's own mean and deviation, which are exported next to the weights.

taskArgs: `data`, `label` (default trip_completed), `features` (comma-separated; default the three above),
`hidden` (default 16; 0 = logistic regression).
"""

from __future__ import annotations

import functools
import io
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..task import TaskContext, TrainTask

DATA_ENV = "LOOM_TRAINING_DATA"
DATA_ENDPOINT_ENV = "LOOM_TRAINING_DATA_ENDPOINT"
DEFAULT_FEATURES = ("conv_rate", "acc_rate", "avg_daily_trips")
DEFAULT_LABEL = "trip_completed"


def read_table(location: str, endpoint: str | None = None) -> dict[str, list[Any]]:
    """The parquet file at `location` (a path or s3://bucket/key) as columns of Python values."""
    import pyarrow.parquet as pq

    if location.startswith("s3://"):
        import boto3

        bucket, key = location.removeprefix("s3://").split("/", 1)
        client = boto3.client("s3", endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL_S3"))
        raw = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        table = pq.read_table(io.BytesIO(raw))
    else:
        table = pq.read_table(location)
    return dict(table.to_pydict())


@functools.lru_cache(maxsize=4)
def load(
    location: str, endpoint: str | None, features: tuple[str, ...], label: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training tensors, read once per process (build_model and build_data both need them)."""
    return tensors(read_table(location, endpoint), list(features), label)


def tensors(columns: dict[str, list[Any]], features: list[str], label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, labels) of the rows that have every feature; a clear error for a column that is missing."""
    missing = [name for name in [*features, label] if name not in columns]
    if missing:
        raise ValueError(f"training set lacks column(s) {missing}; it has {sorted(columns)}")
    rows = [
        ([float(columns[f][i]) for f in features], float(columns[label][i]))
        for i in range(len(columns[label]))
        if all(columns[f][i] is not None for f in features) and columns[label][i] is not None
    ]
    if not rows:
        raise ValueError("no training row has every feature (the entity dataframe is outside the view's ttl?)")
    x = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    y = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    return x, y


class Standardize(nn.Module):
    """(x - mean) / std with the training set's statistics, kept as buffers so the export carries them."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("std", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class TabularData:
    """Random rows per (step, rank), each from its own seeded generator: a batch is a pure function of its
    position, so a resumed run sees exactly the batches it would have seen."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y, self.seed = x, y, seed

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((self.seed, step, rank, world_size)) & 0x7FFFFFFF)
        index = torch.randint(len(self.y), (batch_size,), generator=generator)
        return self.x[index], self.y[index]


class DriverConversionTask(TrainTask):
    def _features(self, args: dict[str, Any]) -> list[str]:
        raw = args.get("features")
        return [f.strip() for f in str(raw).split(",") if f.strip()] if raw else list(DEFAULT_FEATURES)

    def _table(self, args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        location = args.get("data") or os.environ.get(DATA_ENV)
        if not location:
            raise ValueError(f"no training set: set taskArgs data=... or spec.trainingData (env {DATA_ENV})")
        label = str(args.get("label") or DEFAULT_LABEL)
        return load(str(location), os.environ.get(DATA_ENDPOINT_ENV), tuple(self._features(args)), label)

    def build_model(self, ctx: TaskContext) -> nn.Module:
        x, _ = self._table(ctx.args)
        width, hidden = x.shape[1], int(ctx.args.get("hidden", 16))
        scale = Standardize(width)
        scale.mean.copy_(x.mean(dim=0))
        scale.std.copy_(x.std(dim=0).clamp_min(1e-6))
        if hidden:
            return nn.Sequential(scale, nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        return nn.Sequential(scale, nn.Linear(width, 1))

    def build_data(self, ctx: TaskContext) -> TabularData:
        x, y = self._table(ctx.args)
        return TabularData(x, y, ctx.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x).squeeze(-1).float()
        return F.binary_cross_entropy_with_logits(logits, y)

    def export_config(self, model: nn.Module) -> dict[str, Any]:
        return {"architecture": "driver-conversion-mlp", "model": repr(model)}


task = DriverConversionTask()
