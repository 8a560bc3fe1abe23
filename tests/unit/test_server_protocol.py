"""Open Inference Protocol v2 codecs: JSON shapes, datatypes, validation and the binary extension."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from loom.workloads.server.model import InferResponse, Tensor
from loom.workloads.server.protocol import (
    ProtocolError,
    decode_infer_request,
    encode_infer_response,
    tensor,
)


def decode(doc: dict[str, Any]) -> Any:
    return decode_infer_request(json.dumps(doc).encode(), None)


def one_input(name: str, shape: list[int], datatype: str, data: Any) -> dict[str, Any]:
    return {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]}


@pytest.mark.parametrize(
    ("datatype", "data", "dtype"),
    [
        ("FP32", [1, 2.5, 3, 4], np.float32),
        ("FP64", [1.0, 2.0, 3.0, 4.0], np.float64),
        ("FP16", [0.5, 1, 2, 4], np.float16),
        ("INT64", [1, -2, 3, 2**40], np.int64),
        ("INT8", [1, -2, 3, 127], np.int8),
        ("UINT8", [0, 1, 2, 255], np.uint8),
        ("BOOL", [True, False, True, True], np.bool_),
    ],
)
def test_flat_data_is_decoded_with_shape_and_dtype(datatype: str, data: list[Any], dtype: Any) -> None:
    decoded = decode(one_input("x", [2, 2], datatype, data))
    array = decoded.request.inputs["x"].data
    assert array.shape == (2, 2)
    assert array.dtype == np.dtype(dtype)
    assert array.reshape(-1).tolist() == [dtype(v).item() for v in data]


def test_nested_data_row_major_and_bytes() -> None:
    decoded = decode(
        {
            "id": "req-7",
            "parameters": {"temperature": 0.5},
            "inputs": [
                {"name": "x", "shape": [2, 3], "datatype": "INT32", "data": [[1, 2, 3], [4, 5, 6]]},
                {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["héllo", "world"]},
            ],
            "outputs": [{"name": "y"}, {"name": "z", "parameters": {"binary_data": True}}],
        }
    )
    request = decoded.request
    assert request.id == "req-7"
    assert request.parameters == {"temperature": 0.5}
    assert request.inputs["x"].data.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert request.inputs["s"].data.tolist() == ["héllo", "world"]
    assert request.requested_outputs == ["y", "z"]
    assert decoded.binary_outputs == {"z"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (one_input("x", [3], "FP32", [1, 2]), "needs 3 elements, data has 2"),
        (one_input("x", [2], "FLOAT", [1, 2]), "unknown datatype 'FLOAT'"),
        (one_input("x", [2], "INT64", [1.5, 2]), "does not match datatype INT64"),
        (one_input("x", [2], "BOOL", [1, 0]), "does not match datatype BOOL"),
        (one_input("x", [1], "INT8", [300]), "out of range for INT8"),
        (one_input("x", [1], "UINT8", [-1]), "out of range for UINT8"),
        (one_input("x", [2], "FP32", ["a", "b"]), "does not match datatype FP32"),
        (one_input("x", [2], "BYTES", [1, 2]), "BYTES data must be strings"),
        (one_input("x", [-1], "FP32", []), "must be >= 0"),
        (one_input("x", "2", "FP32", [1, 2]), "shape must be a list of integers"),
        (one_input("x", [2, 2], "FP32", [[1, 2], [3]]), "not a regular array"),
        ({"inputs": []}, "non-empty 'inputs'"),
        ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, "needs a 'name'"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, "has no data"),
        ({**one_input("x", [1], "FP32", [1]), "id": 5}, "'id' must be a string"),
    ],
)
def test_bad_requests_are_rejected_with_a_message(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(doc)
    assert caught.value.status == 400
    assert message in str(caught.value)


def test_invalid_json_is_a_400() -> None:
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode_infer_request(b"{not json", None)


def test_binary_inputs_are_read_after_the_json_header() -> None:
    floats = np.arange(6, dtype=np.float32)
    strings = b"".join(struct.pack("<I", len(s)) + s for s in (b"ab", b"\xff\x00"))
    header = json.dumps(
        {
            "inputs": [
                {"name": "f", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": 24}},
                {"name": "s", "shape": [2], "datatype": "BYTES",
                 "parameters": {"binary_data_size": len(strings)}},
            ]
        }
    ).encode()
    decoded = decode_infer_request(header + floats.tobytes() + strings, str(len(header)))
    assert decoded.request.inputs["f"].data.tolist() == floats.reshape(2, 3).tolist()
    assert decoded.request.inputs["s"].data.tolist() == [b"ab", b"\xff\x00"]
    assert "binary_data_size" not in decoded.request.inputs["f"].parameters


def test_binary_size_that_does_not_match_the_shape_is_rejected() -> None:
    header = json.dumps(
        {"inputs": [{"name": "f", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}
    ).encode()
    with pytest.raises(ProtocolError, match="needs 16 bytes"):
        decode_infer_request(header + b"\0" * 8, str(len(header)))


def test_response_echoes_id_and_encodes_json_outputs() -> None:
    decoded = decode({**one_input("x", [1], "FP32", [1]), "id": "abc"})
    response = InferResponse(
        outputs=[tensor("y", np.array([[1.5, 2.0]], dtype=np.float32)), tensor("t", ["a", "b"], "BYTES")]
    )
    body, headers = encode_infer_response("m", "3", decoded, response)
    doc = json.loads(body)
    assert headers["content-type"] == "application/json"
    assert doc == {
        "model_name": "m",
        "model_version": "3",
        "id": "abc",
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.0]},
            {"name": "t", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
        ],
    }


def test_binary_outputs_when_asked_for() -> None:
    decoded = decode(
        {**one_input("x", [1], "FP32", [1]), "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    )
    values = np.array([1, 2, 3], dtype=np.int64)
    body, headers = encode_infer_response(
        "m", None, decoded, InferResponse(outputs=[Tensor("y", "INT64", values)])
    )
    split = int(headers["Inference-Header-Content-Length"])
    doc = json.loads(body[:split])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 24}
    assert "data" not in doc["outputs"][0]
    assert np.frombuffer(body[split:], dtype="<i8").tolist() == [1, 2, 3]
