"""A linear scorer over named numeric inputs: the tabular model of the feature-enrichment example.

Handler ``loom.workloads.server.tabular:LinearModel``. The model folder holds ``linear.json``::

    {"weights": {"driver_stats__conv_rate": 2.0, "driver_stats__acc_rate": 1.0}, "bias": 0.0, "output": "score"}

and each request's ``score`` (FP32, shape ``[N]``) is ``bias + sum(weight * input)`` row by row. The inputs are
whatever tensors carry those names: with ``spec.features`` they are the online features the server adds
(``<featureView>__<feature>``), so the client sends only the entity key. Pure numpy, no download beyond the JSON:
the example runs on CPU anywhere. Other inputs (the entity key) are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .handlers import Arrays, RowBatchedModel
from .model import ModelError, TensorSpec

MODEL_FILE = "linear.json"
# The example's model (examples/inferenceservice-feature-enriched.yaml): the local stack seeds it into S3.
EXAMPLE_MODEL: dict[str, Any] = {
    "weights": {
        "driver_stats__conv_rate": 2.0,
        "driver_stats__acc_rate": 1.0,
        "driver_stats__avg_daily_trips": 0.001,
    },
    "bias": 0.0,
    "output": "score",
}


class LinearModel(RowBatchedModel):
    platform = "loom-linear"

    def load(self, folder: Path) -> None:
        path = folder / MODEL_FILE
        try:
            doc = json.loads(path.read_text())
            weights = {str(k): float(v) for k, v in dict(doc["weights"]).items()}
            bias = float(doc.get("bias", 0.0))
            output = str(doc.get("output", "score"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: expected {{'weights': {{name: number}}, 'bias': number}}: {exc}") from exc
        if not weights:
            raise ValueError(f"{path}: weights is empty")
        self.weights, self.bias, self.output = weights, bias, output

    def forward(self, inputs: Arrays) -> Arrays:
        missing = [name for name in self.weights if name not in inputs]
        if missing:
            raise ModelError(f"missing input(s) {', '.join(missing)} (is the InferenceService's features set?)")
        rows = next(iter(inputs.values())).shape[0]
        score = np.full(rows, self.bias, dtype=np.float64)
        for name, weight in self.weights.items():
            column = np.asarray(inputs[name], dtype=np.float64).reshape(rows, -1)
            if column.shape[1] != 1:
                raise ModelError(f"input {name!r} must have one value per row, got shape {list(inputs[name].shape)}")
            score += weight * column[:, 0]
        return {self.output: score.astype(np.float32)}

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(name, "FP32", [-1]) for name in self.weights]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output, "FP32", [-1])]
