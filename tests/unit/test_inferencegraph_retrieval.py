"""An InferenceGraph's retrieve steps: the spec's admission rules, the vector FeatureView's status.vectorSearch
resolved into the router's store, and what keeps a graph from rendering (a missing or unready view, an embedding
service other than the one that embedded the documents), reported with the cause."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.api.crd import model_schema
from loom.operator.kinds.inferencegraph.api import GraphStep, InferenceGraphSpec
from loom.operator.kinds.inferencegraph.controller import services_named, views_named
from loom.operator.kinds.inferencegraph.render import graph_issues_of, observe_service, router_config
from loom.operator.kinds.inferencegraph.retrieval import observe_view
from loom.workloads.router.config import RouterConfig

OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceGraph",
         "metadata": {"name": "ask", "namespace": "team", "uid": "u1", "generation": 1}}


def isvc(name: str, model: str | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team"}, "spec": {"model": {"name": model or name}},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Serving"}]}}


def view(name: str = "docs", **vector_search: Any) -> dict[str, Any]:
    found = {
        "url": "http://handbook-features.team.svc:80", "feastView": "docs",
        "featureRefs": ["docs:text", "docs:section", "docs:embedding"], "textField": "text",
        "field": "embedding", "metric": "cosine", "dimension": 32,
        "embedding": {"service": "embedder", "url": "http://embedder.team.svc:80/v1/embeddings", "model": "e5"},
        **vector_search,
    }
    return {"metadata": {"name": name, "namespace": "team"}, "status": {"vectorSearch": found}}


def spec(**retrieve: Any) -> InferenceGraphSpec:
    step = {"name": "answer", "serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard",
            "retrieve": {"featureView": "docs", **retrieve}}
    return InferenceGraphSpec.model_validate({"nodes": {"root": {"routerType": "Sequence", "steps": [step]}}})


SERVICES = {name: observe_service(isvc(name)) for name in ("llm", "embedder", "other-embedder")}


def test_the_views_vector_search_becomes_the_routers_store() -> None:
    config, problem = router_config(OWNER, spec(topK=3), SERVICES, {"docs": observe_view(view())})
    assert problem is None and config is not None
    store = config.stores["docs"]
    assert store.search_url == "http://handbook-features.team.svc:80/search"
    # The vector is never asked for: the prompt has no use for it.
    assert store.feature_refs == ["docs:text", "docs:section"]
    assert (store.embedding.url, store.embedding.model_name) == ("http://embedder.team.svc:80/v1/embeddings", "e5")
    step = config.nodes["root"].steps[0]
    assert step.retrieve is not None and step.retrieve.top_k == 3
    # What the ConfigMap holds is what the router reads back.
    assert RouterConfig.from_json(config.to_json()) == config


def test_a_missing_or_unready_view_waits_with_its_reason() -> None:
    _, missing = router_config(OWNER, spec(), SERVICES, {})
    assert missing is not None and missing.reason == "FeatureViewNotFound" and "docs" in missing.message
    bare = {"metadata": {"name": "docs", "namespace": "team"}, "status": {}}
    _, unready = router_config(OWNER, spec(), SERVICES, {"docs": observe_view(bare)})
    assert unready is not None and unready.reason == "FeatureViewNotReady"
    assert "status.vectorSearch" in unready.message


def test_the_embedding_service_must_be_the_one_that_embedded_the_documents() -> None:
    views = {"docs": observe_view(view())}
    _, mismatch = router_config(OWNER, spec(embeddingService="other-embedder"), SERVICES, views)
    assert mismatch is not None and mismatch.reason == "InvalidGraph"
    assert "other-embedder differs from embedder" in mismatch.message
    # Naming the same one is fine; a view that does not say which model embedded it needs one named.
    same, problem = router_config(OWNER, spec(embeddingService="embedder"), SERVICES, views)
    assert problem is None and same is not None
    assert same.stores["docs"].embedding.url == "http://embedder.team.svc:80/v1/embeddings"
    unnamed = {"docs": observe_view(view(embedding=None))}
    _, needs = router_config(OWNER, spec(), SERVICES, unnamed)
    assert needs is not None and needs.reason == "InvalidGraph" and "set retrieve.embeddingService" in needs.message
    named, problem = router_config(OWNER, spec(embeddingService="other-embedder"), SERVICES, unnamed)
    assert problem is None and named is not None
    assert named.stores["docs"].embedding.model_name == "other-embedder"
    _, absent = router_config(OWNER, spec(embeddingService="nowhere"), SERVICES, unnamed)
    assert absent is not None and absent.reason == "ServiceNotFound" and "nowhere" in absent.message


def test_retrieve_needs_an_openai_chat_step() -> None:
    plain = InferenceGraphSpec.model_validate({"nodes": {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "llm", "retrieve": {"featureView": "docs"}}]}}})
    issues = graph_issues_of(plain)
    assert [(i.node, i.step) for i in issues] == [("root", 0)]
    assert "retrieve applies to steps with protocol openai-chat" in issues[0].message
    assert graph_issues_of(spec()) == []


def test_admission_rules_are_in_the_schema() -> None:
    schema = model_schema(GraphStep)
    rules = [v["rule"] for v in schema["x-kubernetes-validations"]]
    assert "!has(self.retrieve) || (has(self.protocol) && self.protocol == 'openai-chat')" in rules
    retrieve = schema["properties"]["retrieve"]
    assert any("{question}" in v["rule"] for v in retrieve["x-kubernetes-validations"])
    assert retrieve["properties"]["topK"]["maximum"] == 50
    assert retrieve["properties"]["onFailure"]["enum"] == ["AnswerWithoutContext", "Fail"]


def test_the_indexes_read_raw_specs() -> None:
    raw = {"nodes": {"root": {"steps": [
        {"serviceName": "llm", "retrieve": {"featureView": "docs", "embeddingService": "embedder"}},
        "junk", {"retrieve": "junk"}]}, "bad": "junk"}}
    assert services_named(raw) == {"llm", "embedder"}
    assert views_named(raw) == {"docs"}
    assert views_named(None) == set()


@pytest.mark.parametrize("template", ["no placeholders", "{question} only"])
def test_a_template_without_both_placeholders_is_refused_by_the_router_model(template: str) -> None:
    issues = graph_issues_of(spec(promptTemplate=template))
    assert issues and "promptTemplate must contain" in issues[0].message
