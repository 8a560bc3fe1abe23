"""Feature enrichment against a fake Feast feature server (httpx.MockTransport speaking Feast's HTTP API): where
entity keys are read, the request sent, the tensors added, and every failure a clear, typed, counted error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from loom.workloads.server.app import status_of
from loom.workloads.server.config import BatchingConfig, EnrichmentConfig, ServerConfig
from loom.workloads.server.dataplane import DataPlane
from loom.workloads.server.enrichment import (
    Enricher,
    EntityKeyMissingError,
    EntityNotFoundError,
    FeatureServerError,
    entity_rows,
    feast_request,
    feature_tensors,
    tensor_name,
)
from loom.workloads.server.errors import InvalidInputError, UnavailableError
from loom.workloads.server.metrics import ServerMetrics
from loom.workloads.server.model import InferRequest, Tensor
from loom.workloads.server.tabular import EXAMPLE_MODEL, MODEL_FILE, LinearModel

pytestmark = pytest.mark.timeout(60)

URL = "http://rides-features.team.svc"
# What the feature server holds: driver -> (conv_rate, acc_rate, avg_daily_trips, history, city).
ONLINE: dict[int, tuple[float, float, int, list[float], str]] = {
    1001: (0.5, 0.25, 100, [1.0, 2.0], "Lisbon"),
    1002: (0.75, 0.5, 200, [3.0, 4.0], "Porto"),
}
FEATURES = [
    {"name": "conv_rate", "dtype": "Float32"},
    {"name": "acc_rate", "dtype": "Float32"},
    {"name": "avg_daily_trips", "dtype": "Int64"},
    {"name": "history", "dtype": "Array(Float32)"},
    {"name": "city", "dtype": "String"},
]


def config(**overrides: Any) -> EnrichmentConfig:
    doc: dict[str, Any] = {
        "url": URL,
        "featureView": "driver_stats",
        "features": FEATURES,
        "entityKeys": ["driver_id"],
        "connectRetries": 2,
    }
    doc.update(overrides)
    return EnrichmentConfig.model_validate(doc)


def feast_answer(body: dict[str, Any], expired: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Feast's /get-online-features document (feature_names with the join key first, values and statuses)."""
    drivers = body["entities"]["driver_id"]
    refs = [ref.split(":", 1)[1] for ref in body["features"]]
    results = [{"values": drivers, "statuses": ["PRESENT"] * len(drivers), "event_timestamps": []}]
    for ref in refs:
        index = [f["name"] for f in FEATURES].index(ref)
        values: list[Any] = []
        statuses: list[str] = []
        for driver in drivers:
            row = ONLINE.get(driver)
            if row is None:
                values.append(None)
                statuses.append("NOT_FOUND")
            elif driver in expired:
                values.append(row[index])
                statuses.append("OUTSIDE_MAX_AGE")
            else:
                values.append(row[index])
                statuses.append("PRESENT")
        results.append({"values": values, "statuses": statuses, "event_timestamps": []})
    return {"metadata": {"feature_names": ["driver_id", *refs]}, "results": results}


class FakeFeast:
    """Counts calls; `fail` decides per call (an exception to raise, or an httpx.Response to answer)."""

    def __init__(self, fail: Callable[[int], Exception | httpx.Response | None] | None = None, **answer: Any):
        self.calls: list[dict[str, Any]] = []
        self.fail = fail
        self.answer = answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert (request.method, str(request.url)) == ("POST", f"{URL}/get-online-features")
        body = json.loads(request.content)
        self.calls.append(body)
        outcome = self.fail(len(self.calls)) if self.fail else None
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(outcome, httpx.Response):
            return outcome
        return httpx.Response(200, json=feast_answer(body, **self.answer))


def enricher(fake: FakeFeast, registry: CollectorRegistry | None = None, **overrides: Any) -> Enricher:
    return Enricher(config(**overrides), "ranker", registry or CollectorRegistry(), httpx.MockTransport(fake))


def keyed(*drivers: int, **extra: Tensor) -> InferRequest:
    return InferRequest(inputs={"driver_id": Tensor("driver_id", "INT64", np.array(drivers)), **extra})


def errors(registry: CollectorRegistry, reason: str) -> float:
    labels = {"model": "ranker", "feature_view": "driver_stats", "reason": reason}
    return registry.get_sample_value("loom_server_enrichment_errors_total", labels) or 0.0


# ------------------------------------------------------------------------------------------- pure mapping


def test_entity_keys_come_from_the_input_tensor_or_the_parameters() -> None:
    cfg = config()
    assert entity_rows(cfg, keyed(1001, 1002)) == {"driver_id": [1001, 1002]}
    column = InferRequest(inputs={"driver_id": Tensor("driver_id", "INT64", np.array([[7], [8]]))})
    assert entity_rows(cfg, column) == {"driver_id": [7, 8]}
    assert entity_rows(cfg, InferRequest(inputs={}, parameters={"driver_id": 1001})) == {"driver_id": [1001]}
    assert entity_rows(cfg, InferRequest(inputs={}, parameters={"driver_id": [1, 2]})) == {"driver_id": [1, 2]}
    words = InferRequest(inputs={"city_id": Tensor("city_id", "BYTES", np.array([b"lis"], dtype=object))})
    assert entity_rows(config(entityKeys=["city_id"]), words) == {"city_id": ["lis"]}
    rows = entity_rows(cfg, keyed(1001))
    assert type(rows["driver_id"][0]) is int  # JSON for Feast, not a numpy scalar
    assert feast_request(cfg, rows) == {
        "features": [
            "driver_stats:conv_rate",
            "driver_stats:acc_rate",
            "driver_stats:avg_daily_trips",
            "driver_stats:history",
            "driver_stats:city",
        ],
        "entities": {"driver_id": [1001]},
    }


def test_a_missing_or_malformed_entity_key_is_refused_naming_it() -> None:
    cfg = config(entityKeys=["driver_id", "rider_id"])
    with pytest.raises(EntityKeyMissingError, match="no entity key 'rider_id'"):
        entity_rows(cfg, keyed(1001))
    with pytest.raises(EntityKeyMissingError, match="different row counts: driver_id=2, rider_id=1"):
        entity_rows(cfg, InferRequest(inputs={}, parameters={"driver_id": [1, 2], "rider_id": 3}))
    square = InferRequest(inputs={"driver_id": Tensor("driver_id", "INT64", np.zeros((2, 2), dtype=np.int64))})
    with pytest.raises(EntityKeyMissingError, match=r"shape \[N\] or \[N, 1\]"):
        entity_rows(config(), square)
    with pytest.raises(InvalidInputError, match="driver_stats__conv_rate"):
        entity_rows(config(), keyed(1001, driver_stats__conv_rate=Tensor("x", "FP32", np.array([1.0]))))
    assert status_of(EntityKeyMissingError("x")) == 400


def test_features_become_typed_tensors_named_view__feature_one_row_per_entity() -> None:
    cfg = config()
    rows = {"driver_id": [1002, 1001]}
    tensors = {t.name: t for t in feature_tensors(cfg, rows, feast_answer(feast_request(cfg, rows)))}
    assert list(tensors) == [tensor_name("driver_stats", f["name"]) for f in FEATURES]
    conv = tensors["driver_stats__conv_rate"]
    assert (conv.datatype, conv.shape, conv.data.dtype) == ("FP32", [2], np.float32)
    assert conv.data.tolist() == [0.75, 0.5]
    trips = tensors["driver_stats__avg_daily_trips"]
    assert (trips.datatype, trips.data.dtype, trips.data.tolist()) == ("INT64", np.int64, [200, 100])
    history = tensors["driver_stats__history"]
    assert (history.datatype, history.shape, history.data.tolist()) == ("FP32", [2, 2], [[3.0, 4.0], [1.0, 2.0]])
    city = tensors["driver_stats__city"]
    assert (city.datatype, city.data.tolist()) == ("BYTES", [b"Porto", b"Lisbon"])


def test_an_unknown_or_expired_entity_is_an_error_naming_it_never_an_empty_feature() -> None:
    cfg = config()
    rows = {"driver_id": [1001, 9999]}
    with pytest.raises(EntityNotFoundError) as unknown:
        feature_tensors(cfg, rows, feast_answer(feast_request(cfg, rows)))
    message = str(unknown.value)
    assert "driver_id=9999: unknown entity" in message and "conv_rate NOT_FOUND" in message
    assert "1001" not in message
    rows = {"driver_id": [1001]}
    with pytest.raises(EntityNotFoundError, match=r"driver_id=1001: no value for \(conv_rate OUTSIDE_MAX_AGE"):
        feature_tensors(cfg, rows, feast_answer(feast_request(cfg, rows), expired=frozenset({1001})))
    assert status_of(EntityNotFoundError("x")) == 400


def test_an_answer_that_is_not_feasts_document_is_a_feature_server_error() -> None:
    cfg = config()
    with pytest.raises(FeatureServerError, match="unexpected document"):
        feature_tensors(cfg, {"driver_id": [1]}, {"detail": "nope"})
    partial = feast_answer(feast_request(config(features=FEATURES[:1]), {"driver_id": [1001]}))
    with pytest.raises(FeatureServerError, match="did not return driver_stats:acc_rate"):
        feature_tensors(cfg, {"driver_id": [1001]}, partial)
    assert status_of(FeatureServerError("x")) == 503


# ------------------------------------------------------------------------------------------- the enricher


async def test_enrich_adds_the_features_and_keeps_the_request() -> None:
    registry = CollectorRegistry()
    fake = FakeFeast()
    request = keyed(1001, extra=Tensor("extra", "FP32", np.array([3.0])))
    request.parameters["p"] = 1
    request.id = "r1"
    got = await enricher(fake, registry).enrich(request)
    assert list(got.inputs)[:2] == ["driver_id", "extra"]
    assert got.inputs["driver_stats__acc_rate"].data.tolist() == [0.25]
    assert (got.parameters, got.id) == ({"p": 1}, "r1")
    assert len(fake.calls) == 1
    labels = {"model": "ranker", "feature_view": "driver_stats"}
    assert registry.get_sample_value("loom_server_enrichment_duration_seconds_count", labels) == 1


async def test_connect_errors_are_retried_then_a_clear_503() -> None:
    flaky = FakeFeast(fail=lambda n: httpx.ConnectError("refused") if n == 1 else None)
    enriched = await enricher(flaky).enrich(keyed(1001))
    assert enriched.inputs["driver_stats__conv_rate"].data.tolist() == [0.5]
    assert len(flaky.calls) == 2
    registry = CollectorRegistry()
    down = FakeFeast(fail=lambda n: httpx.ConnectError("connection refused"))
    with pytest.raises(FeatureServerError, match=f"feature server {URL} unreachable: ConnectError") as err:
        await enricher(down, registry, connectRetries=1).enrich(keyed(1001))
    assert isinstance(err.value, UnavailableError) and len(down.calls) == 2
    assert errors(registry, "unavailable") == 1


async def test_timeouts_and_error_answers_are_not_retried() -> None:
    registry = CollectorRegistry()
    slow = FakeFeast(fail=lambda n: httpx.ReadTimeout("slow"))
    with pytest.raises(FeatureServerError, match="did not answer within 250 ms"):
        await enricher(slow, registry, timeoutMs=250).enrich(keyed(1001))
    assert len(slow.calls) == 1 and errors(registry, "unavailable") == 1
    registry = CollectorRegistry()
    broken = FakeFeast(fail=lambda n: httpx.Response(500, text='{"class": "FeatureViewNotFoundException"}'))
    with pytest.raises(FeatureServerError, match=r"answered 500 for view driver_stats: .*FeatureViewNotFound"):
        await enricher(broken, registry).enrich(keyed(1001))
    assert len(broken.calls) == 1 and errors(registry, "bad_response") == 1


async def test_errors_are_counted_by_reason() -> None:
    registry = CollectorRegistry()
    enrich = enricher(FakeFeast(), registry)
    with pytest.raises(EntityNotFoundError):
        await enrich.enrich(keyed(9999))
    with pytest.raises(EntityKeyMissingError):
        await enrich.enrich(InferRequest(inputs={}))
    assert errors(registry, "entity_not_found") == 1
    assert errors(registry, "missing_entity_key") == 1


# ------------------------------------------------------------------------------------------- through the plane


@pytest.fixture
def linear_folder(tmp_path: Path) -> Path:
    (tmp_path / MODEL_FILE).write_text(json.dumps(EXAMPLE_MODEL))
    return tmp_path


async def test_the_model_sees_the_features_through_the_data_plane(linear_folder: Path) -> None:
    model = LinearModel("ranker")
    metrics = ServerMetrics("ranker")
    fake = FakeFeast()
    enrich = Enricher(config(features=FEATURES[:3]), "ranker", metrics.registry, httpx.MockTransport(fake))
    plane = DataPlane(model, BatchingConfig(max_latency_ms=1), metrics, enrich)
    await plane.start(linear_folder)
    try:
        while not plane.ready:
            await asyncio.sleep(0.01)
        answer = await plane.infer("ranker", None, keyed(1001, 1002))
        score = next(t for t in answer.outputs if t.name == "score")
        expected = [2.0 * 0.5 + 0.25 + 0.001 * 100, 2.0 * 0.75 + 0.5 + 0.001 * 200]
        assert score.data.tolist() == pytest.approx(expected)
        with pytest.raises(EntityNotFoundError, match="driver_id=4242"):
            await plane.infer("ranker", None, keyed(4242))
        fake.fail = lambda n: httpx.ConnectError("refused")
        with pytest.raises(UnavailableError, match="unreachable"):
            await plane.infer("ranker", None, keyed(1001))
    finally:
        await plane.stop()


def test_without_features_the_linear_model_names_what_is_missing(linear_folder: Path) -> None:
    model = LinearModel("ranker")
    model.load(linear_folder)
    [result] = model.predict([keyed(1001)])
    assert isinstance(result, Exception) and "driver_stats__conv_rate" in str(result)
    assert [s.name for s in model.inputs()] == list(EXAMPLE_MODEL["weights"])


def test_the_server_config_carries_the_enrichment_and_refuses_what_cannot_work() -> None:
    doc = {"modelName": "ranker", "features": config().model_dump(by_alias=True)}
    parsed = ServerConfig.model_validate(json.loads(ServerConfig.model_validate(doc).to_json()))
    assert parsed.features == config()
    with pytest.raises(ValidationError, match="unknown Feast dtype 'Float16'"):
        config(features=[{"name": "x", "dtype": "Float16"}])
    with pytest.raises(ValidationError, match="Feast view name"):
        config(featureView="driver-stats")
    with pytest.raises(ValidationError):
        config(entityKeys=[])
