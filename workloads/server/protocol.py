"""Open Inference Protocol v2 (KServe / Triton) messages and codecs, free of any transport.

Infer requests and responses, server and model metadata, and the generate extension's request and
response; the HTTP routes (app.py) only move these bytes and documents.

JSON tensors (``data`` flat or nested, row-major) and the binary tensor extension that standard
clients (tritonclient, KServe's InferenceRESTClient) use by default: the JSON header's length in the
``Inference-Header-Content-Length`` HTTP header, raw tensors after it, ``binary_data_size`` per input.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .model import InferRequest, InferResponse, Tensor, TensorSpec

HEADER_LENGTH = "inference-header-content-length"

# Protocol datatype -> numpy dtype (little-endian: the binary extension's byte order).
NUMPY_TYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
# numpy kinds a JSON value may have for each datatype family: ints never silently become floats.
_ACCEPTED_KINDS = {"BOOL": "b", "UINT": "iu", "INT": "iu", "FP": "iuf", "BYTES": "OUS"}


class ProtocolError(Exception):
    """A malformed request: answered with ``{"error": message}`` and ``status``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class DecodedRequest:
    request: InferRequest
    # Output names to send in binary form; binary_all covers every output.
    binary_outputs: set[str] = field(default_factory=set)
    binary_all: bool = False


def datatype_of(array: np.ndarray[Any, Any]) -> str:
    """The protocol datatype for a numpy array (str/bytes/object arrays are BYTES)."""
    if array.dtype.kind in "OUS":
        return "BYTES"
    for name, dtype in NUMPY_TYPES.items():
        if name != "BYTES" and dtype == array.dtype.newbyteorder("<"):
            return name
    raise ProtocolError(f"numpy dtype {array.dtype} has no protocol datatype", 500)


def _family(datatype: str) -> str:
    for prefix in ("UINT", "INT", "FP"):
        if datatype.startswith(prefix):
            return prefix
    return datatype


def _shape(raw: Any, name: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in raw):
        raise ProtocolError(f"input {name!r}: shape must be a list of integers")
    if any(d < 0 for d in raw):
        raise ProtocolError(f"input {name!r}: shape dimensions must be >= 0")
    return tuple(raw)


def _from_json(data: Any, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray[Any, Any]:
    expected = math.prod(shape)
    try:
        raw = np.array(data, dtype=object if datatype == "BYTES" else None)
    except ValueError as exc:  # ragged nesting
        raise ProtocolError(f"input {name!r}: data is not a regular array ({exc})") from exc
    flat = raw.reshape(-1)
    if flat.size != expected:
        raise ProtocolError(
            f"input {name!r}: shape {list(shape)} needs {expected} elements, data has {flat.size}"
        )
    if datatype == "BYTES":
        if not all(isinstance(v, str | bytes) for v in flat):
            raise ProtocolError(f"input {name!r}: BYTES data must be strings")
        return flat.reshape(shape)
    if flat.size and flat.dtype.kind not in _ACCEPTED_KINDS[_family(datatype)]:
        raise ProtocolError(f"input {name!r}: data does not match datatype {datatype}")
    dtype = NUMPY_TYPES[datatype]
    if flat.size and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if flat.min() < info.min or flat.max() > info.max:
            raise ProtocolError(f"input {name!r}: values out of range for {datatype}")
    try:
        return np.array(flat, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise ProtocolError(f"input {name!r}: {exc}") from exc


def _from_binary(blob: bytes, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray[Any, Any]:
    expected = math.prod(shape)
    if datatype == "BYTES":
        items: list[bytes] = []
        offset = 0
        while offset < len(blob):
            if offset + 4 > len(blob):
                raise ProtocolError(f"input {name!r}: truncated BYTES element")
            (length,) = struct.unpack_from("<I", blob, offset)
            items.append(blob[offset + 4 : offset + 4 + length])
            offset += 4 + length
        if len(items) != expected or offset != len(blob):
            raise ProtocolError(f"input {name!r}: shape {list(shape)} needs {expected} BYTES elements")
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array.reshape(shape)
    dtype = NUMPY_TYPES[datatype]
    if len(blob) != expected * dtype.itemsize:
        raise ProtocolError(
            f"input {name!r}: shape {list(shape)} of {datatype} needs {expected * dtype.itemsize} bytes,"
            f" got {len(blob)}"
        )
    return np.frombuffer(blob, dtype=dtype).reshape(shape).copy()


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # nesting deeper than the parser's stack: a client error, not a server one
        raise ProtocolError("request body is nested too deeply") from exc


def decode_infer_request(body: bytes, header_length: str | None) -> DecodedRequest:
    """Parse an infer request body (JSON, or JSON + binary tensors) into a handler request."""
    try:
        split = len(body) if header_length is None else int(header_length)
    except ValueError as exc:
        raise ProtocolError("Inference-Header-Content-Length must be an integer") from exc
    if not 0 <= split <= len(body):
        raise ProtocolError("Inference-Header-Content-Length exceeds the body")
    doc = _parse_json(body[:split])
    if not isinstance(doc, dict):
        raise ProtocolError("request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("request needs a non-empty 'inputs' list")
    binary = memoryview(body)[split:]
    offset = 0
    inputs: dict[str, Tensor] = {}
    for entry in raw_inputs:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError("each input needs a 'name'")
        name = entry["name"]
        if name in inputs:
            raise ProtocolError(f"input {name!r} given twice")
        datatype = entry.get("datatype")
        if datatype not in NUMPY_TYPES:
            raise ProtocolError(f"input {name!r}: unknown datatype {datatype!r}")
        shape = _shape(entry.get("shape"), name)
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise ProtocolError(f"input {name!r}: parameters must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ProtocolError(f"input {name!r}: binary_data_size does not fit the body")
            array = _from_binary(bytes(binary[offset : offset + size]), datatype, shape, name)
            offset += size
        elif "data" in entry:
            array = _from_json(entry["data"], datatype, shape, name)
        else:
            raise ProtocolError(f"input {name!r} has no data")
        params = {k: v for k, v in params.items() if k != "binary_data_size"}
        inputs[name] = Tensor(name=name, datatype=datatype, data=array, parameters=params)
    if offset != len(binary):
        raise ProtocolError("binary data left over after the last input")

    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError("'parameters' must be an object")
    decoded = DecodedRequest(
        request=InferRequest(inputs=inputs, parameters=parameters),
        binary_all=bool(parameters.get("binary_data_output", False)),
    )
    request_id = doc.get("id")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise ProtocolError("'id' must be a string")
        decoded.request.id = request_id
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise ProtocolError("'outputs' must be a list")
        names: list[str] = []
        for entry in raw_outputs:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ProtocolError("each requested output needs a 'name'")
            names.append(entry["name"])
            if (entry.get("parameters") or {}).get("binary_data"):
                decoded.binary_outputs.add(entry["name"])
        decoded.request.requested_outputs = names
    return decoded


def _json_value(array: np.ndarray[Any, Any]) -> list[Any]:
    flat = array.reshape(-1)
    if flat.dtype.kind in "OUS":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    values: list[Any] = flat.tolist()
    return values


def _binary_value(array: np.ndarray[Any, Any], datatype: str) -> bytes:
    if datatype == "BYTES":
        parts = []
        for value in array.reshape(-1):
            raw = value if isinstance(value, bytes) else str(value).encode()
            parts.append(struct.pack("<I", len(raw)) + raw)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=NUMPY_TYPES[datatype]).tobytes()


def encode_infer_response(
    model_name: str, model_version: str | None, decoded: DecodedRequest, response: InferResponse
) -> tuple[bytes, dict[str, str]]:
    """Serialize one response; returns the body and the extra headers it needs."""
    doc: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    if decoded.request.id is not None:
        doc["id"] = decoded.request.id
    if response.parameters:
        doc["parameters"] = response.parameters
    blobs: list[bytes] = []
    outputs = []
    for tensor in response.outputs:
        array = np.asarray(tensor.data)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(array.shape)}
        params = dict(tensor.parameters)
        if decoded.binary_all or tensor.name in decoded.binary_outputs:
            blob = _binary_value(array, tensor.datatype)
            params["binary_data_size"] = len(blob)
            blobs.append(blob)
        else:
            entry["data"] = _json_value(array)
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, {"content-type": "application/json"}
    return header + b"".join(blobs), {
        "content-type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


def tensor(name: str, data: Any, datatype: str | None = None) -> Tensor:
    """Build an output tensor from anything numpy accepts; datatype inferred when not given."""
    array = np.asarray(data, dtype=object) if datatype == "BYTES" else np.asarray(data)
    return Tensor(name=name, datatype=datatype or datatype_of(array), data=array)


# --- metadata and the generate extension ---------------------------------------------------------


@dataclass(frozen=True)
class ServerMetadata:
    """``GET /v2``."""

    name: str
    version: str
    extensions: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "extensions": list(self.extensions)}


@dataclass(frozen=True)
class ModelMetadata:
    """``GET /v2/models/{name}[/versions/{version}]``."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def to_dict(self) -> dict[str, Any]:
        def spec(tensor: TensorSpec) -> dict[str, Any]:
            return {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}

        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": self.platform,
            "inputs": [spec(t) for t in self.inputs],
            "outputs": [spec(t) for t in self.outputs],
        }


@dataclass(frozen=True)
class GenerateRequest:
    """The generate extension's request: ``{"text_input", "parameters", "id"}``."""

    text_input: str
    parameters: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class GenerateResponse:
    """One generate answer (or one streamed piece)."""

    model_name: str
    model_version: str | None
    text_output: str
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "model_name": self.model_name, "model_version": self.model_version, "text_output": self.text_output,
        }
        if self.id is not None:
            doc["id"] = self.id
        return doc


def decode_generate_request(body: bytes) -> GenerateRequest:
    """Parse a generate (or generate_stream) request body."""
    doc = _parse_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("text_input"), str):
        raise ProtocolError("generate needs a JSON object with a string 'text_input'")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError("'parameters' must be an object")
    request_id = doc.get("id")
    return GenerateRequest(
        text_input=doc["text_input"], parameters=parameters, id=request_id if isinstance(request_id, str) else None
    )
