"""The vector FeatureViews a graph's retrieve steps name, resolved into the router's stores (pure: no I/O).

A retrieve step names a FeatureView; what the router needs of it is in the view's `status.vectorSearch` (written by
the FeatureView controller once the view holds vectors): the feature server's URL, the Feast view and its feature
references, the text field, the vector field (never asked for: it is large and the prompt has no use for it), the
metric, and the embedding service whose model made the vectors. The question must be embedded by that same model:
a step naming another `embeddingService` is refused (InvalidGraph); a view that does not say which model made its
vectors needs the step to name one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loom.workloads.router.retrieval_config import EmbeddingConfig, VectorStoreConfig

from ...core.kit import Manifest
from ..inferenceservice.render import SERVICE_PORT
from .api import InferenceGraphSpec, Retrieve

EMBEDDINGS_PATH = "/v1/embeddings"
SEARCH_PATH = "/search"


@dataclass(frozen=True)
class ViewRef:
    """A FeatureView as read from the API server: its name and its status.vectorSearch (None: none yet)."""

    name: str
    vector_search: Mapping[str, Any] | None


@dataclass(frozen=True)
class StoreProblem:
    """Why a retrieve step's store cannot be resolved now. FeatureViewNotFound / FeatureViewNotReady: waiting (the
    graph is re-reconciled when the view changes); InvalidGraph: the spec must change."""

    reason: str
    message: str


def retrieve_steps(spec: InferenceGraphSpec) -> list[Retrieve]:
    return [s.retrieve for node in spec.nodes.values() for s in node.steps if s.retrieve is not None]


def referenced_views(spec: InferenceGraphSpec) -> list[str]:
    """Every FeatureView a retrieve step names, sorted, once each."""
    return sorted({r.feature_view for r in retrieve_steps(spec)})


def embedding_services(spec: InferenceGraphSpec) -> list[str]:
    """Every InferenceService a retrieve step names as its embedding service, sorted, once each."""
    return sorted({r.embedding_service for r in retrieve_steps(spec) if r.embedding_service})


def observe_view(body: Manifest) -> ViewRef:
    vector_search = (body.get("status") or {}).get("vectorSearch")
    return ViewRef(str(body["metadata"]["name"]), vector_search if isinstance(vector_search, dict) else None)


def _feature(ref: str) -> str:
    return ref.rsplit(":", 1)[-1]


def resolve_store(
    retrieve: Retrieve, view: ViewRef | None, embedders: Mapping[str, tuple[str, str]]
) -> VectorStoreConfig | StoreProblem:
    """The router's store for one retrieve step. ``embedders``: InferenceService name -> (its URL without a path,
    its served model name), for the services the steps name."""
    name = retrieve.feature_view
    if view is None:
        return StoreProblem("FeatureViewNotFound", f"FeatureView {name} not found")
    found = view.vector_search
    if not found or not found.get("url") or not found.get("featureRefs") or not found.get("textField"):
        return StoreProblem(
            "FeatureViewNotReady",
            f"FeatureView {name} has no vector search yet (status.vectorSearch): is it a vector view, applied?",
        )
    vector_field = found.get("field", found.get("vectorField"))
    refs = [str(ref) for ref in found["featureRefs"] if _feature(str(ref)) != vector_field]
    raw_embedding = found.get("embedding")
    embedding: Mapping[str, Any] = raw_embedding if isinstance(raw_embedding, dict) else {}
    view_service = embedding.get("service")
    wanted = retrieve.embedding_service
    if wanted is not None and view_service and wanted != view_service:
        return StoreProblem(
            "InvalidGraph",
            f"retrieve.embeddingService {wanted} differs from {view_service}, whose model embedded FeatureView "
            f"{name}'s documents: vectors of two models do not compare (leave embeddingService out)",
        )
    if wanted is not None:
        if wanted not in embedders:
            return StoreProblem("ServiceNotFound", f"InferenceService(s) not found: {wanted}")
        url, model = embedders[wanted]
        endpoint = EmbeddingConfig(url=f"{url}{EMBEDDINGS_PATH}", model_name=model)
    elif embedding.get("url") and embedding.get("model"):
        endpoint = EmbeddingConfig(url=str(embedding["url"]), model_name=str(embedding["model"]))
    else:
        return StoreProblem(
            "InvalidGraph",
            f"FeatureView {name} does not say which model embedded its documents (status.vectorSearch.embedding): "
            "set retrieve.embeddingService to the InferenceService serving that model",
        )
    return VectorStoreConfig(
        search_url=str(found["url"]).rstrip("/") + SEARCH_PATH,
        feature_refs=refs,
        text_field=str(found["textField"]),
        metric=str(found.get("metric") or "cosine"),
        embedding=endpoint,
    )


def placeholder_store(name: str) -> VectorStoreConfig:
    """A stand-in for a view while the graph's structure is judged (whether the view exists is judged later)."""
    return VectorStoreConfig(
        search_url=f"http://{name}:{SERVICE_PORT}{SEARCH_PATH}", feature_refs=[f"{name}:text"], text_field="text",
        embedding=EmbeddingConfig(url=f"http://{name}:{SERVICE_PORT}{EMBEDDINGS_PATH}", model_name=name),
    )
