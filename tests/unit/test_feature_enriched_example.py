"""examples/inferenceservice-feature-enriched.yaml fits what it names: the FeatureView example it reads from, the
model the local stack seeds, and a model whose inputs are exactly the tensors enrichment adds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loom.devstack import backing
from loom.operator.kinds.inferenceservice.api import InferenceService
from loom.operator.kinds.inferenceservice.enrichment.resolve import resolve_features
from loom.workloads.server.enrichment import tensor_name
from loom.workloads.server.tabular import EXAMPLE_MODEL

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


def test_the_enriched_example_reads_the_feature_view_example_and_a_seeded_model() -> None:
    isvc = InferenceService.model_validate(load("inferenceservice-feature-enriched.yaml"))
    view = load("featureview-driver-stats.yaml")
    assert isvc.spec.features is not None and isvc.spec.features.feature_view == view["metadata"]["name"]
    assert isvc.spec.model.uri == f"s3://{backing.MODELS_BUCKET}/{backing.EXAMPLE_MODEL_PREFIX}"
    assert isvc.spec.model.endpoint == backing.S3_URL
    assert isvc.spec.model.secret_ref is not None and isvc.spec.model.secret_ref.name == backing.SECRET_NAME

    view["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    enrichment = resolve_features(isvc.spec.features, view, "default")
    added = {tensor_name(enrichment.feature_view, f.name) for f in enrichment.features}
    assert set(EXAMPLE_MODEL["weights"]) == added
    assert enrichment.url == "http://rides-features.default.svc"
