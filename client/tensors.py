"""numpy arrays <-> Open Inference Protocol v2 JSON tensors (pure). numpy is imported here only, on first use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from loom.workloads.server.protocol import NUMPY_TYPES

# The model server's own table (protocol datatype -> little-endian numpy dtype), so both sides agree by construction.
DATATYPES: Mapping[str, np.dtype[Any]] = {name: dtype for name, dtype in NUMPY_TYPES.items() if name != "BYTES"}


def datatype(array: np.ndarray[Any, Any]) -> str:
    if array.dtype.kind in "OUS":
        return "BYTES"
    for name, dtype in DATATYPES.items():
        if dtype == array.dtype.newbyteorder("<"):
            return name
    raise TypeError(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype")


def encode_input(name: str, value: Any) -> dict[str, Any]:
    array = np.asarray(value)
    kind = datatype(array)
    flat = array.reshape(-1)
    if kind == "BYTES":
        data: list[Any] = [v.decode() if isinstance(v, bytes) else str(v) for v in flat.tolist()]
    else:
        data = flat.tolist()
    return {"name": name, "shape": list(array.shape), "datatype": kind, "data": data}


def encode_request(
    inputs: Mapping[str, Any], outputs: list[str] | None = None, parameters: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An infer request body: one tensor per named input (arrays, lists or scalars)."""
    if not inputs:
        raise ValueError("predict needs at least one input tensor")
    body: dict[str, Any] = {"inputs": [encode_input(name, value) for name, value in inputs.items()]}
    if outputs:
        body["outputs"] = [{"name": name} for name in outputs]
    if parameters:
        body["parameters"] = dict(parameters)
    return body


def decode_outputs(response: Mapping[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """Output name -> array of its datatype and shape."""
    decoded: dict[str, np.ndarray[Any, Any]] = {}
    for output in response.get("outputs") or []:
        kind = output.get("datatype", "FP32")
        dtype = np.dtype(object) if kind == "BYTES" else DATATYPES[kind]
        decoded[output["name"]] = np.array(output.get("data") or [], dtype=dtype).reshape(output.get("shape") or [-1])
    return decoded
