"""The followers index: which InferenceServices a TrainingJob's or a FeatureView's change re-runs (follows.py)."""

from __future__ import annotations

from typing import Any

from loom.operator.kinds.inferenceservice.source.follows import followed, followers, index_entries


def test_the_model_the_adapters_and_the_feature_view_are_followed() -> None:
    spec = {
        "model": {"fromTrainingJob": {"name": "trainer"}},
        "adapters": [{"name": "sql", "fromTrainingJob": {"name": "tune-sql"}}, {"name": "chat", "uri": "s3://a/b"}],
        "features": {"featureView": "drivers"},
    }
    assert followed(spec) == {("TrainingJob", "trainer"), ("TrainingJob", "tune-sql"), ("FeatureView", "drivers")}


def test_a_service_that_follows_nothing_has_no_entries() -> None:
    assert followed({"model": {"uri": "s3://models/v1"}}) == set()
    assert index_entries("ml", "svc", {"model": {"uri": "s3://models/v1"}}) == {}


def test_any_stored_shape_is_read_without_an_error() -> None:
    # The index sees every stored object, including ones the schema of an older version let through.
    stored: list[Any] = [
        None, {}, {"model": "s3://x"}, {"model": {"fromTrainingJob": "trainer"}}, {"adapters": "a"},
        {"adapters": [None, 3]}, {"features": []}, {"model": {"fromTrainingJob": {"name": 3}}},
    ]  # fmt: skip
    for spec in stored:
        assert followed(spec) == set()


def test_entries_are_keyed_by_kind_namespace_and_name() -> None:
    spec = {"model": {"fromTrainingJob": {"name": "trainer"}}, "features": {"featureView": "drivers"}}
    assert index_entries("ml", "svc", spec) == {
        ("TrainingJob", "ml", "trainer"): "svc",
        ("FeatureView", "ml", "drivers"): "svc",
    }


def test_followers_are_looked_up_by_kind_and_namespace() -> None:
    # A Kopf index: key -> the values of every object that returned that key.
    index: dict[Any, Any] = {
        ("TrainingJob", "ml", "trainer"): ["b-svc", "a-svc"],
        ("FeatureView", "ml", "trainer"): ["by-view"],
        ("TrainingJob", "other", "trainer"): ["elsewhere"],
    }
    assert followers(index, "TrainingJob", "ml", "trainer") == ["a-svc", "b-svc"]
    assert followers(index, "FeatureView", "ml", "trainer") == ["by-view"]
    assert followers(index, "TrainingJob", "ml", "nobody") == []
    assert followers(None, "TrainingJob", "ml", "trainer") == []
