"""A served model's tensor signature (names, OIP datatypes, shapes): what ``GET /v2/models/{m}`` lists.

Generic OIP clients, UIs and the InferenceGraph router discover a model's inputs and outputs from
its metadata, so tensor handlers must describe them. Two sources:

* a torch.export program describes itself: user inputs and outputs of its graph signature, their
  fake tensors' dtypes and shapes (a dynamic dimension, e.g. the batch, is ``-1``);
* a TorchScript module's signature carries no dtypes or shapes, so it is described by an optional
  ``model-settings.json`` beside the weights (the same ``inputs``/``outputs`` entries as MLServer's
  model settings; other keys are ignored, so an MLServer file works as is)::

      {
        "inputs":  [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "out", "datatype": "FP32", "shape": [-1, 2]},
                    {"name": "out_sum", "datatype": "FP32", "shape": [-1]}]
      }

  Inputs are listed in the order the module takes them (positional); outputs in the order it
  returns them, and their names name the returned tensors. The file also wins over a torch.export
  program's own signature when both exist (e.g. to give outputs friendlier names).

Nothing here imports torch: a server for another handler never pays for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .model import TensorSpec

if TYPE_CHECKING:
    from torch.export import ExportedProgram

SETTINGS_FILE = "model-settings.json"

# OIP datatypes a tensor may be described with (BF16 is in the protocol, though this server's codecs
# cannot carry it yet: a model that takes BF16 says so honestly rather than pretending FP32).
Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
]

# str(torch.dtype) -> OIP datatype; keyed by name so this module needs no torch import.
TORCH_DATATYPES: dict[str, str] = {
    "torch.bool": "BOOL",
    "torch.uint8": "UINT8",
    "torch.uint16": "UINT16",
    "torch.uint32": "UINT32",
    "torch.uint64": "UINT64",
    "torch.int8": "INT8",
    "torch.int16": "INT16",
    "torch.int32": "INT32",
    "torch.int64": "INT64",
    "torch.float16": "FP16",
    "torch.float32": "FP32",
    "torch.float64": "FP64",
    "torch.bfloat16": "BF16",
}


class _TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: list[int]
    parameters: dict[str, Any] = Field(default_factory=dict)

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, value: list[int]) -> list[int]:
        if any(d < -1 for d in value):
            raise ValueError("shape dimensions must be >= 0, or -1 for any size")
        return value


class ModelSettings(BaseModel):
    """The ``inputs``/``outputs`` part of a model-settings.json (MLServer's layout)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    inputs: list[_TensorEntry] = Field(default_factory=list)
    outputs: list[_TensorEntry] = Field(default_factory=list)

    @field_validator("inputs", "outputs")
    @classmethod
    def _unique(cls, value: list[_TensorEntry]) -> list[_TensorEntry]:
        names = [entry.name for entry in value]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor names must be unique, got {names}")
        return value


@dataclass(frozen=True)
class Signature:
    """What a tensor model takes and returns, as OIP metadata."""

    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.outputs]


def _specs(entries: list[_TensorEntry]) -> list[TensorSpec]:
    return [TensorSpec(e.name, e.datatype, list(e.shape)) for e in entries]


def read_settings(*folders: Path) -> Signature | None:
    """The signature in the first ``model-settings.json`` found in ``folders``; None when there is none.

    A file that exists but is malformed is an error (a typo must not silently hide the metadata).
    """
    for folder in folders:
        path = folder / SETTINGS_FILE
        if not path.is_file():
            continue
        try:
            settings = ModelSettings.model_validate(json.loads(path.read_text()))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise ValueError(f"{path} is not a valid model settings file: {exc}") from exc
        return Signature(inputs=_specs(settings.inputs), outputs=_specs(settings.outputs))
    return None


def torch_datatype(dtype: object) -> str:
    """The OIP datatype of a torch dtype (e.g. torch.float32 -> FP32)."""
    try:
        return TORCH_DATATYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no Open Inference Protocol datatype") from None


def _shape(sizes: Any) -> list[int]:
    # Symbolic sizes (torch.SymInt, the dims declared dynamic at export) accept any size: -1.
    return [d if isinstance(d, int) else -1 for d in sizes]


def export_signature(program: ExportedProgram, output_names: list[str] | None = None) -> Signature:
    """Inputs and outputs of a torch.export program, from its graph signature and fake tensors.

    Output names: ``output_names`` when given, the keys when the program returns a dict, else
    ``output__<i>`` (Triton's convention, and what the handler names a returned tuple).
    """
    from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

    values = {node.name: node.meta.get("val") for node in program.graph.nodes}

    def spec(name: str) -> TensorSpec:
        value = values.get(name)
        if value is None or not hasattr(value, "dtype"):
            raise ValueError(f"exported program has no tensor metadata for {name!r}")
        return TensorSpec(name, torch_datatype(value.dtype), _shape(value.shape))

    signature = program.graph_signature
    inputs = [
        spec(s.arg.name)
        for s in signature.input_specs
        if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument)
    ]
    outputs = [
        spec(s.arg.name)
        for s in signature.output_specs
        if s.kind == OutputKind.USER_OUTPUT and isinstance(s.arg, TensorArgument)
    ]
    names = output_names
    if names is None:
        out_spec = program.call_spec.out_spec
        if out_spec is not None and out_spec.type is dict:
            names = [str(key) for key in out_spec.context]
        else:
            names = [f"output__{i}" for i in range(len(outputs))]
    if len(names) != len(outputs):
        raise ValueError(f"{len(names)} output names ({', '.join(names)}) for {len(outputs)} outputs")
    return Signature(
        inputs=inputs,
        outputs=[TensorSpec(name, o.datatype, o.shape) for name, o in zip(names, outputs, strict=True)],
    )
