"""spec.features resolved against a FeatureView (pure): what the server's enrichment gets, and every reason it
cannot be built yet (a condition on the InferenceService, never a crash)."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.kinds.inferenceservice.enrichment.api import FeatureEnrichment
from loom.operator.kinds.inferenceservice.enrichment.resolve import resolve_features
from loom.operator.kinds.inferenceservice.source.model import ResolveError
from loom.workloads.server.config import EnrichedFeature


def view(ready: bool = True, url: str | None = "http://rides-features.ml.svc", **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "project": "rides",
        "entities": [{"name": "driver", "joinKeys": ["driver_id"]}, {"name": "city_id", "valueType": "String"}],
        "features": [{"name": "conv_rate", "dtype": "Float32"}, {"name": "history", "dtype": "Array(Float64)"}],
        "source": {"path": "s3://data/driver_stats.parquet"},
    }
    doc.update(spec)
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "reason": "Applying", "message": "m"}]
    status: dict[str, Any] = {"conditions": conditions}
    if url:
        status["url"] = url
    return {"metadata": {"name": "driver-stats"}, "spec": doc, "status": status}


def wants(*keys: str) -> FeatureEnrichment:
    return FeatureEnrichment(feature_view="driver-stats", entity_keys=list(keys))


def test_a_ready_view_gives_the_feast_name_every_feature_the_keys_and_the_server_url() -> None:
    got = resolve_features(wants("city_id", "driver_id"), view(), "ml")
    assert (got.url, got.feature_view, got.entity_keys) == (
        "http://rides-features.ml.svc",
        "driver_stats",
        ["city_id", "driver_id"],
    )
    assert got.features == [
        EnrichedFeature(name="conv_rate", dtype="Float32"),
        EnrichedFeature(name="history", dtype="Array(Float64)"),
    ]
    # Before the view's status names its server, the URL is the project's Service as the controller names it.
    assert resolve_features(wants("driver_id", "city_id"), view(url=None), "team").url == (
        "http://rides-features.team.svc"
    )


@pytest.mark.parametrize(
    ("obj", "keys", "reason", "transient", "text"),
    [
        (None, ("driver_id", "city_id"), "FeatureViewNotFound", True, "does not exist in namespace ml"),
        (view(ready=False), ("driver_id", "city_id"), "FeatureViewNotReady", True, "Applying: m"),
        (view(), ("driver", "city_id"), "FeatureViewMismatch", False, "driver not a join key"),
        (view(), ("driver_id",), "FeatureViewMismatch", False, "join key(s) city_id missing"),
        (view(online=False), ("driver_id", "city_id"), "FeatureViewMismatch", False, "online: false"),
    ],
)
def test_what_cannot_be_resolved_is_a_reason_with_a_message(
    obj: dict[str, Any] | None, keys: tuple[str, ...], reason: str, transient: bool, text: str
) -> None:
    with pytest.raises(ResolveError) as err:
        resolve_features(wants(*keys), obj, "ml")
    assert (err.value.reason, err.value.transient) == (reason, transient)
    assert text in err.value.message
