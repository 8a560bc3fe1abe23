"""Fuzzed Open Inference Protocol requests (hypothesis strategies) and the rule every answer must follow.

Each strategy yields a `Probe`: the endpoint suffix, the body bytes, the extra headers, and whether the request is
certainly invalid (then the answer must be a 4xx; otherwise a 200 is fine too). Never a 5xx, never a dropped
connection, and a 4xx always carries {"error": "<message>"}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BYTES")
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class Probe:
    family: str
    endpoint: str  # "infer", "generate" or "generate_stream"
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    invalid: bool = True  # certainly invalid: only a 4xx will do


def good_infer(value: int = 5) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [value]}]}


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)
)
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6),
                     inner, max_size=4), max_leaves=12)


def _not_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return True
    return False


malformed_json = st.one_of(
    st.binary(max_size=120),
    st.builds(lambda cut: json.dumps(good_infer()).encode()[:cut], st.integers(0, 60)),
    st.sampled_from([b"{", b"[", b'{"inputs": [', b"\xff\xfe\x00", b'{"inputs": [{"name": "x",}]}', b"NaN x"]),
).filter(_not_json).map(lambda body: Probe("malformed-json", "infer", body))

_shape = st.one_of(
    st.lists(st.integers(-3, 2**40), max_size=4), st.lists(_json_leaf, max_size=3), _json_leaf
)
_input = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.text(max_size=6), _json_leaf),
        "shape": _shape,
        "datatype": st.one_of(st.sampled_from(DATATYPES), st.text(max_size=5), _json_leaf),
        "data": _json,
        "parameters": st.one_of(st.dictionaries(st.text(max_size=6), _json, max_size=2), _json_leaf),
    },
)
wrong_types_and_shapes = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(_input, max_size=3), _json)},
    optional={"id": _json, "parameters": _json, "outputs": _json},
).map(lambda doc: Probe("wrong-types-shapes", "infer", json.dumps(doc).encode(), invalid=False))

deep_nesting = st.builds(
    lambda depth, where: Probe(
        "deep-nesting",
        "infer",
        (
            b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ' + b"[" * depth + b"]" * depth
            + b"}]}"
        )
        if where == "data"
        else b"[" * depth + b"]" * depth,
    ),
    st.sampled_from([100, 1_000, 5_000, 100_000]),
    st.sampled_from(["data", "root"]),
)


def _lying_binary(header_value: str, declared: int, tail: bytes) -> Probe:
    doc = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": declared}}]}
    head = json.dumps(doc).encode()
    body = head + tail
    honest = header_value == str(len(head)) and declared == len(tail) == 8
    return Probe("lying-binary-length", "infer", body, {HEADER_LENGTH: header_value}, invalid=not honest)


lying_binary_length = st.builds(
    _lying_binary,
    st.one_of(
        st.integers(-10, 400).map(str), st.sampled_from(["", "abc", "1e3", "1_2", "99999999999999999999", "0x10", "+7"])
    ),
    st.one_of(st.integers(-5, 64), st.just(2**62)),
    st.binary(max_size=24),
)

bad_generate = st.one_of(
    st.fixed_dictionaries({}, optional={"text_input": _json_leaf.filter(lambda v: not isinstance(v, str)),
                                        "parameters": _json_leaf, "id": _json}),
    st.lists(_json_leaf, max_size=3),
).map(lambda doc: Probe("bad-generate", "generate", json.dumps(doc).encode()))

ALL = st.one_of(malformed_json, wrong_types_and_shapes, deep_nesting, lying_binary_length, bad_generate)


def problem(probe: Probe, status: int, body: bytes) -> str | None:
    """What is wrong with one answer, or None."""
    if status >= 500:
        return f"{probe.family}: {status} {body[:200]!r}"
    if probe.invalid and not 400 <= status < 500:
        return f"{probe.family}: answered {status} to an invalid request"
    if 400 <= status < 500:
        try:
            message = json.loads(body).get("error")
        except (ValueError, AttributeError):
            message = None
        if not message:
            return f"{probe.family}: {status} without an error message: {body[:200]!r}"
    return None
