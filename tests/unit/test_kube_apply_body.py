"""The body of a server-side apply is parsed as YAML by kube-apiserver, whose parser refuses JSON's surrogate-pair
escapes ("\\ud83d\\ude42"): any character outside the BMP (an emoji in a description) made every apply of that object
fail with 400 and its status was never written. Found by the chaos spec fuzzer."""

from __future__ import annotations

import json

import yaml

from loom.operator.core.client import APPLY_CONTENT_TYPE, apply_body


def test_characters_outside_the_bmp_use_yaml_32_bit_escapes_and_round_trip() -> None:
    manifest = {"data": {"d": "smile 🙂 and 𝄞", "k": "ascii", "n": "é ✓"}, "list": ["🙂", 1, None, True]}
    body = apply_body(manifest)
    text = body.decode("ascii")  # nothing but ASCII on the wire
    assert "\\ud83d" not in text and "\\U0001f642" in text
    assert yaml.safe_load(body) == manifest


def test_escaped_backslashes_are_left_alone() -> None:
    manifest = {"literal": "\\ud83d\\ude42 is text, not an escape", "mixed": "\\🙂"}
    assert yaml.safe_load(apply_body(manifest)) == manifest
    assert json.loads(json.dumps(manifest)) == manifest


def test_the_body_is_sent_as_is() -> None:
    # The kubernetes client re-encodes a body whose content type is exactly application/apply-patch+yaml (or says
    # json); with a parameter it sends the bytes as they are, and the API server ignores the parameter.
    assert APPLY_CONTENT_TYPE.startswith("application/apply-patch+yaml;")
    assert "json" not in APPLY_CONTENT_TYPE
