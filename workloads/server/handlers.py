"""Built-in handlers and the lookup of a handler by name or 'module:Class'.

Tensor models (TorchScript, torch.export, MLflow pyfunc) batch the usual way: every request carries
a leading batch dimension, requests with the same input signature are concatenated along it, run
once, and the outputs are split back by each request's row count. Requests whose signatures differ
are run as separate groups, so one odd request never breaks the others.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .config import BUILTIN_HANDLER_CLASSES
from .model import (
    InferRequest,
    InferResponse,
    Model,
    ModelError,
    Tensor,
    TensorSpec,
    select_outputs,
)
from .protocol import NUMPY_TYPES, datatype_of
from .signature import Signature, export_signature, read_settings

# Built-in handler names and their classes are listed once, in the config (the operator validates against it).
BUILTINS: dict[str, str] = BUILTIN_HANDLER_CLASSES

Arrays = dict[str, np.ndarray[Any, Any]]


def load_handler_class(spec: str) -> type[Model]:
    """Resolve 'noop' or 'package.module:Class' to a Model subclass."""
    target = BUILTINS.get(spec, spec)
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise TypeError(f"handler {spec!r} is not a loom.workloads.server.model.Model subclass")
    return cls


class NoopModel(Model):
    """Echoes its inputs; measures the server's own overhead in benchmarks."""

    platform = "noop"

    def load(self, folder: Path) -> None:
        self.ready = True

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        results: list[InferResponse | Exception] = []
        for request in batch:
            try:
                outputs = select_outputs(request, list(request.inputs.values()))
                results.append(InferResponse(outputs=outputs, parameters=dict(request.parameters)))
            except ModelError as exc:
                results.append(exc)
        return results


class RowBatchedModel(Model):
    """Base for models that take arrays with a leading batch dimension."""

    def forward(self, inputs: Arrays) -> Arrays:
        """Run the model on the concatenated rows of a group of requests."""
        raise NotImplementedError

    @staticmethod
    def _signature(request: InferRequest) -> tuple[Any, ...]:
        for tensor in request.inputs.values():
            if tensor.data.ndim == 0:
                raise ModelError(f"input {tensor.name!r} needs a leading batch dimension")
        return tuple(sorted((t.name, t.datatype, t.data.shape[1:]) for t in request.inputs.values()))

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        results: list[InferResponse | Exception | None] = [None] * len(batch)
        groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for index, request in enumerate(batch):
            try:
                groups[self._signature(request)].append(index)
            except ModelError as exc:
                results[index] = exc
        for members in groups.values():
            try:
                self._run_group([batch[i] for i in members], members, results)
            except Exception as exc:
                if len(members) == 1:
                    results[members[0]] = exc
                else:  # isolate the request that broke the group
                    for i in members:
                        try:
                            self._run_group([batch[i]], [i], results)
                        except Exception as single:
                            results[i] = single
        return [r if r is not None else RuntimeError("no result") for r in results]

    def _run_group(
        self, requests: list[InferRequest], slots: list[int], results: list[InferResponse | Exception | None]
    ) -> None:
        names = list(requests[0].inputs)
        rows = [r.inputs[names[0]].data.shape[0] for r in requests]
        for request in requests:
            if any(t.data.shape[0] != request.inputs[names[0]].data.shape[0] for t in request.inputs.values()):
                raise ModelError("all inputs of a request must have the same batch size")
        merged = {n: np.concatenate([r.inputs[n].data for r in requests]) for n in names}
        outputs = self.forward(merged)
        total = sum(rows)
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != total:
                raise RuntimeError(f"output {name!r} has {array.shape} rows for {total} input rows")
        start = 0
        for request, slot, count in zip(requests, slots, rows, strict=True):
            tensors = [
                Tensor(name=n, datatype=datatype_of(a), data=a[start : start + count]) for n, a in outputs.items()
            ]
            start += count
            try:
                results[slot] = InferResponse(outputs=select_outputs(request, tensors))
            except ModelError as exc:
                results[slot] = exc


def _find_file(folder: Path, options: dict[str, Any], suffixes: tuple[str, ...]) -> Path:
    if "file" in options:
        return folder / str(options["file"])
    candidates = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not candidates:
        raise FileNotFoundError(f"no {'/'.join(suffixes)} file in {folder}")
    return candidates[0]


class _TorchModel(RowBatchedModel):
    """Shared by TorchScript and torch.export: positional inputs, named outputs.

    The signature (metadata, input order, output names) comes from a ``model-settings.json`` beside
    the weights when there is one, else from the model itself (only torch.export programs carry one);
    ``handlerOptions.inputs``/``outputs`` name the tensors when neither does.
    """

    module: Any
    device: str = "cpu"
    signature: Signature = Signature()

    def _device(self) -> str:
        import torch

        device = str(self.options.get("device", "auto"))
        if device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return device

    def _settings(self, folder: Path, weights: Path) -> Signature | None:
        settings = read_settings(weights.parent, folder)
        if settings is not None:
            for key, names in (("inputs", settings.input_names), ("outputs", settings.output_names)):
                given = self.options.get(key)
                if given is not None and list(given) != names:
                    raise ValueError(f"handlerOptions.{key} {list(given)} disagrees with model-settings.json {names}")
        return settings

    def inputs(self) -> list[TensorSpec]:
        return list(self.signature.inputs)

    def outputs(self) -> list[TensorSpec]:
        return list(self.signature.outputs)

    def _input_order(self, inputs: Arrays) -> list[str]:
        if self.options.get("inputs"):
            return [str(name) for name in self.options["inputs"]]
        declared = self.signature.input_names
        # Clients that use the advertised names are matched by name; others (written before the
        # metadata listed inputs) keep the positional meaning of their request's order.
        if declared and set(declared) == set(inputs):
            return declared
        return list(inputs)

    def forward(self, inputs: Arrays) -> Arrays:
        import torch

        order = self._input_order(inputs)
        missing = [n for n in order if n not in inputs]
        if missing:
            raise ModelError(f"missing input(s): {', '.join(missing)}")
        with torch.inference_mode():
            args = [torch.from_numpy(np.ascontiguousarray(inputs[n])).to(self.device) for n in order]
            result = self.module(*args)
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, dict):
            items = list(result.items())
        else:
            default = [f"output__{i}" for i in range(len(result))]
            names = list(self.options.get("outputs") or self.signature.output_names or default)
            items = list(zip(names, result, strict=True))
        return {name: value.detach().cpu().numpy() for name, value in items}


class TorchScriptModel(_TorchModel):
    platform = "pytorch_torchscript"

    def load(self, folder: Path) -> None:
        import torch

        self.device = self._device()
        path = _find_file(folder, self.options, (".pt", ".pth", ".torchscript"))
        # A TorchScript signature has argument names but no dtypes or shapes: only the settings file
        # can describe the tensors.
        self.signature = self._settings(folder, path) or Signature()
        self.module = torch.jit.load(str(path), map_location=self.device).eval()  # type: ignore[no-untyped-call]
        self.ready = True


class TorchExportModel(_TorchModel):
    platform = "pytorch_export"

    def load(self, folder: Path) -> None:
        import torch

        self.device = self._device()
        path = _find_file(folder, self.options, (".pt2",))
        program = torch.export.load(str(path))
        names = self.options.get("outputs")
        self.signature = self._settings(folder, path) or export_signature(
            program, [str(n) for n in names] if names else None
        )
        self.module = program.module().to(self.device)
        self.ready = True


class MLflowPyfuncModel(RowBatchedModel):
    """An MLflow pyfunc model; several inputs become DataFrame columns, one input an array."""

    platform = "mlflow"

    def load(self, folder: Path) -> None:
        import mlflow.pyfunc

        root = folder
        if not (root / "MLmodel").exists():  # registry downloads may nest the model one level down
            found = sorted(folder.rglob("MLmodel"))
            if not found:
                raise FileNotFoundError(f"no MLmodel file under {folder}")
            root = found[0].parent
        self.module = mlflow.pyfunc.load_model(str(root))
        self.ready = True

    def forward(self, inputs: Arrays) -> Arrays:
        import pandas as pd

        if len(inputs) == 1:
            (data,) = inputs.values()
            model_input: Any = data
        else:
            model_input = pd.DataFrame({n: list(a) if a.ndim > 1 else a for n, a in inputs.items()})
        prediction = self.module.predict(model_input)
        if isinstance(prediction, pd.DataFrame):
            return {str(c): _column(prediction[c].to_numpy()) for c in prediction.columns}
        if isinstance(prediction, pd.Series):
            return {"predictions": _column(prediction.to_numpy())}
        if isinstance(prediction, dict):
            return {str(k): _column(np.asarray(v)) for k, v in prediction.items()}
        return {"predictions": _column(np.asarray(prediction))}


def _column(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Coerce pandas/object columns to a protocol-friendly dtype."""
    if array.dtype.kind == "O" and all(isinstance(v, int | float | np.number) for v in array.reshape(-1)):
        return array.astype(np.float64)
    if array.dtype.kind in "OUS" or array.dtype in NUMPY_TYPES.values():
        return array
    return array.astype(np.float64)
