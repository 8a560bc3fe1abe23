"""Every ready-to-apply example parses and validates against the API models (the e2e tier applies them too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loom.operator.api import KINDS

REPO = Path(__file__).resolve().parents[2]
ALL_EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
MODELS = {kind.kind: kind.model for kind in KINDS}


def loom_documents(path: Path) -> list[dict[str, object]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if str(d.get("apiVersion", "")).startswith("loom.dev/")]


# Examples of Loom objects; the others set up what they use (Kueue's queues), and their own e2e test applies them.
EXAMPLES = [p for p in ALL_EXAMPLES if loom_documents(p)]


def test_the_other_examples_are_kueue_queue_setups_that_an_e2e_test_applies() -> None:
    others = [p for p in ALL_EXAMPLES if p not in EXAMPLES]
    assert others  # the queue setup
    applied = (REPO / "e2e" / "tests" / "test_trainingjob_kueue.py").read_text()
    for path in others:
        groups = {str(d["apiVersion"]).split("/")[0] for d in yaml.safe_load_all(path.read_text()) if d}
        assert groups == {"kueue.x-k8s.io"}, path.name
        assert f'"{path.name}"' in applied, f"{path.name} is applied by no e2e test"


def test_there_are_examples_of_every_kind() -> None:
    kinds = {doc["kind"] for path in EXAMPLES for doc in loom_documents(path)}
    assert {"InferenceGraph", "FeatureView"} <= kinds


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path) -> None:
    docs = loom_documents(path)
    assert docs, f"{path.name} holds no loom.dev object"
    for doc in docs:
        MODELS[str(doc["kind"])].model_validate(doc)
