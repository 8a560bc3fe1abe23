"""Every ready-to-apply example parses and validates against the API models (the e2e tier applies them too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loom.operator.api import KINDS

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
MODELS = {kind.kind: kind.model for kind in KINDS}


def loom_documents(path: Path) -> list[dict[str, object]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if str(d.get("apiVersion", "")).startswith("loom.dev/")]


def test_there_are_examples_of_every_kind() -> None:
    kinds = {doc["kind"] for path in EXAMPLES for doc in loom_documents(path)}
    assert {"InferenceGraph", "FeatureView"} <= kinds


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path) -> None:
    docs = loom_documents(path)
    assert docs, f"{path.name} holds no loom.dev object"
    for doc in docs:
        MODELS[str(doc["kind"])].model_validate(doc)
