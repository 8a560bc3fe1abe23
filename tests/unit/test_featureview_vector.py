"""A FeatureView's spec.vector: admission (CEL), the workload config it renders, and status.vectorSearch with the
VectorIndex condition from what the materialize pod reported."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.featureview.api import FeatureViewSpec
from loom.operator.kinds.featureview.config import Member, model_source, plan_project, view_config
from loom.operator.kinds.featureview.render import render_deployment
from loom.operator.kinds.featureview.status import JobResult, Observed, compute_status
from loom.operator.kinds.featureview.vector.api import VectorSearch, VectorSearchStatus
from loom.operator.kinds.featureview.vector.status import vector_status
from loom.workloads.features.config import VECTOR_STORE_TYPE

NOW = datetime(2026, 1, 3, 12, 0, tzinfo=UTC)


def spec(vector: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "project": "rag",
        "entities": [{"name": "chunk_id", "valueType": "String"}],
        "features": [
            {"name": "text", "dtype": "String"},
            {"name": "embedding", "dtype": "Array(Float32)"},
            {"name": "title", "dtype": "String"},
        ],
        "source": {"path": "/data/docs.parquet"},
        "vector": {"field": "embedding", "dimension": 128, "textField": "text", **(vector or {})},
    }
    body.update(overrides)
    return body


EMBEDDING = {"service": "embedder", "model": "tiny-embed", "chunking": {"size": 200, "overlap": 20}}


def refused(body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        admitted(FeatureViewSpec, body)
    return str(caught.value)


def test_admission_accepts_a_vector_view_and_an_embedded_one() -> None:
    assert admitted(FeatureViewSpec, spec()).vector is not None
    embedded = admitted(FeatureViewSpec, spec({"embedding": EMBEDDING}))
    assert embedded.vector is not None and embedded.vector.embedding is not None


def test_admission_refuses_what_the_store_could_not_index() -> None:
    assert "vector.field must name a feature of dtype Array(Float32)" in refused(spec({"field": "title"}))
    assert "vector.field must name a feature of dtype Array(Float32)" in refused(spec({"field": "missing"}))
    assert "vector.textField must name a feature of dtype String" in refused(spec({"textField": "embedding"}))
    redis = {"online": {"type": "redis", "connectionSecretRef": {"name": "r", "key": "k"}}}
    assert "vector search runs on the sqlite online store" in refused(spec(store=redis))
    no_text = spec({"embedding": EMBEDDING})
    del no_text["vector"]["textField"]
    assert "an embedded view needs vector.textField" in refused(no_text)
    ints = spec({"embedding": EMBEDDING}, entities=[{"name": "chunk_id", "valueType": "Int64"}])
    assert "one entity of valueType String" in refused(ints)
    overlap = spec({"embedding": {**EMBEDDING, "chunking": {"size": 100, "overlap": 100}}})
    assert "chunking.overlap must be smaller than chunking.size" in refused(overlap)
    assert "less than or equal to 8192" in refused(spec({"dimension": 10_000}))


def test_the_workload_config_names_the_embedding_service_its_key_and_where_chunks_go() -> None:
    body = spec({"embedding": {**EMBEDDING, "apiKeySecretRef": {"name": "keys", "key": "embedder"}, "reembed": 2}})
    config = view_config("my-docs", FeatureViewSpec.model_validate(body), "team")
    assert config.vector is not None and config.vector.embedding is not None
    embedding = config.vector.embedding
    assert (embedding.url, embedding.model, embedding.reembed) == ("http://embedder.team.svc", "tiny-embed", 2)
    assert (embedding.chunking.size, embedding.chunking.overlap) == (200, 20)
    assert embedding.api_key_env == "LOOM_EMBEDDING_KEY_MY_DOCS"
    assert embedding.output_path == "/var/lib/loom/features/embedded/my_docs.parquet"
    member = Member("my-docs", "u1", "2026-01-01T00:00:00Z", FeatureViewSpec.model_validate(body), "team")
    plan = plan_project("rag", [member])
    assert plan.config.feature_store_yaml()["online_store"]["type"] == VECTOR_STORE_TYPE
    env = render_deployment("team", plan, "img", None)["spec"]["template"]["spec"]["containers"][0]["env"]
    key = next(e for e in env if e["name"] == "LOOM_EMBEDDING_KEY_MY_DOCS")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "embedder"}  # never the key itself


def test_the_embedding_services_model_source_reaches_the_config() -> None:
    body = spec({"embedding": EMBEDDING})
    member = Member("docs", "u1", "t", FeatureViewSpec.model_validate(body), "team")
    service = {"spec": {"model": {"uri": "s3://models/embed", "secretRef": {"name": "s3"}}}}
    source = model_source(service)
    assert source == '{"secretRef":{"name":"s3"},"uri":"s3://models/embed"}'
    plan = plan_project("rag", [member], {"embedder": source})
    view = plan.config.view("docs")
    assert view.vector is not None and view.vector.embedding is not None
    assert view.vector.embedding.model_source == source
    unknown = plan_project("rag", [member]).config.view("docs")
    assert unknown.vector is not None and unknown.vector.embedding is not None
    assert unknown.vector.embedding.model_source is None
    assert model_source(None) is None and model_source({"spec": {}}) is None


def test_a_project_without_vectors_keeps_feasts_own_sqlite_store() -> None:
    body = spec()
    del body["vector"]
    plan = plan_project("rag", [Member("plain", "u1", "t", FeatureViewSpec.model_validate(body), "team")])
    assert plan.config.feature_store_yaml()["online_store"]["type"] == "sqlite"


def vector(**overrides: Any) -> VectorSearch:
    return VectorSearch.model_validate({"field": "embedding", "dimension": 128, "textField": "text", **overrides})


def status_of(outcome: Any, result: dict[str, Any] | None = None, reason: str | None = None,
              message: str | None = None, previous: VectorSearchStatus | None = None,
              spec_vector: VectorSearch | None = None) -> tuple[VectorSearchStatus | None, Any]:
    return vector_status(
        spec_vector or vector(embedding=EMBEDDING), url="http://rag-features.team.svc", feast_view="docs",
        feature_refs=["docs:text", "docs:embedding", "docs:title"], embedding_url="http://embedder.team.svc",
        outcome=outcome, result=result or {}, reason=reason, message=message, previous=previous,
    )


INDEXED = {"featureViews": [{"name": "docs", "vectorIndex": {
    "documents": 42, "dimension": 128, "metric": "cosine", "model": "tiny-embed@/models/a", "reembed": 1}}]}


def test_vector_status_names_the_endpoint_the_model_and_the_index() -> None:
    status, condition = status_of("Succeeded", INDEXED)
    assert status is not None
    assert status.url == "http://rag-features.team.svc"
    assert status.feature_refs == ["docs:text", "docs:title"]  # the vector itself is not worth returning
    assert status.embedding is not None and status.embedding.url == "http://embedder.team.svc/v1/embeddings"
    assert (status.documents, status.model, status.reembed, status.reembed_needed) == (
        42, "tiny-embed@/models/a", 1, False)
    assert condition == ("True", "Indexed", "42 vectors of 128 (cosine), embedded by tiny-embed@/models/a")
    assert status_of(None) [1] == ("Unknown", "NotYetIndexed", "no materialization has written the index yet")
    assert vector_status(None, url="", feast_view="", feature_refs=[], embedding_url=None, outcome=None,
                         result={}, reason=None, message=None, previous=None) == (None, None)


def test_refusals_name_their_cause_and_a_model_change_asks_for_reembedding() -> None:
    indexed, _ = status_of("Succeeded", INDEXED)
    mismatch = "feature view 'docs' declares vector.dimension 128 but model 'tiny-embed' ... returns vectors of 64"
    status, condition = status_of("Failed", reason="DimensionMismatch", message=mismatch, previous=indexed)
    assert condition == ("False", "DimensionMismatch", mismatch)
    status, condition = status_of("Failed", reason="ReembedNeeded", message="model 'a' ... 'b'", previous=indexed)
    assert status is not None and status.reembed_needed and status.documents == 42  # the old index still serves
    assert condition[:2] == ("False", "ReembedNeeded")
    status, condition = status_of("Failed", reason="Failed", message="boom", previous=indexed)
    assert condition == ("False", "MaterializationFailed", "boom")
    unreachable = "embedding service http://embedder.team.svc is unreachable (GET /v1/models): refused"
    assert status_of("Failed", reason="EmbeddingServiceUnreachable", message=unreachable)[1] == (
        "False", "EmbeddingServiceUnreachable", unreachable)


def test_compute_status_carries_the_vector_condition() -> None:
    run = JobResult("docs-materialize-1", "Failed", created="2026-01-03T11:00:00Z", reason="DimensionMismatch",
                    message="dimension 128 but 64")
    observed = Observed(generation=1, project="rag", feast_view="docs", feature_refs=("docs:text", "docs:embedding"),
                        url="http://rag-features.team.svc", server_replicas=1, server_ready=1, materialization=run,
                        vector=vector(embedding=EMBEDDING), embedding_url="http://embedder.team.svc")
    status, _ = compute_status(observed, None, NOW)
    vector_condition = next(c for c in status.conditions if c.type == "VectorIndex")
    assert (vector_condition.status, vector_condition.reason) == ("False", "DimensionMismatch")
    assert status.vector_search is not None and status.vector_search.dimension == 128
