"""`status.vectorSearch` and the VectorIndex condition (pure), from spec.vector and the newest materialization.

The materialize pod reports, per view, what the index holds after the run (`vectorIndex`: documents, dimension,
metric, the embedding model identity, the re-embedding generation). A run the workload refused says why in its
termination message: DimensionMismatch (the model's vectors are not spec.vector.dimension long),
EmbeddingServiceUnreachable (naming the URL), ReembedNeeded (the service's model is not the index's): those become
the condition's reason and message, and ReembedNeeded also sets `reembedNeeded` until a run with a raised
spec.vector.embedding.reembed succeeds.
"""

from __future__ import annotations

from typing import Any, Literal

from .api import EmbeddingStatus, VectorSearch, VectorSearchStatus

ConditionValue = tuple[Literal["True", "False", "Unknown"], str, str]
# Reasons the workload gives that name the cause themselves (loom.workloads.features.embedding).
VECTOR_REASONS = ("DimensionMismatch", "EmbeddingServiceUnreachable", "ReembedNeeded", "InvalidSource")


def _report(result: dict[str, Any], feast_view: str) -> dict[str, Any] | None:
    for view in result.get("featureViews") or []:
        if view.get("name") == feast_view and isinstance(view.get("vectorIndex"), dict):
            return dict(view["vectorIndex"])
    return None


def vector_status(
    vector: VectorSearch | None,
    *,
    url: str,
    feast_view: str,
    feature_refs: list[str],
    embedding_url: str | None,
    outcome: Literal["Succeeded", "Failed"] | None,
    result: dict[str, Any],
    reason: str | None,
    message: str | None,
    previous: VectorSearchStatus | None,
) -> tuple[VectorSearchStatus | None, ConditionValue | None]:
    """The view's vector search status and its VectorIndex condition; (None, None) for a view without vectors.

    `outcome`, `result`, `reason`, `message`: the newest finished materialization (None while none finished)."""
    if vector is None:
        return None, None
    old = previous or VectorSearchStatus()
    embedding = vector.embedding
    status = VectorSearchStatus(
        url=url,
        feature_refs=[r for r in feature_refs if not r.endswith(f":{vector.field}")],
        field=vector.field,
        text_field=vector.text_field,
        dimension=vector.dimension,
        metric=vector.metric,
        documents=old.documents,
        model=old.model,
        reembed=old.reembed,
        reembed_needed=old.reembed_needed,
        embedding=None
        if embedding is None
        else EmbeddingStatus(service=embedding.service, url=f"{embedding_url}/v1/embeddings", model=embedding.model),
    )
    if old.dimension is not None and old.dimension != vector.dimension:
        status.documents = None  # the index is rebuilt for the new dimension on the next run
    if outcome is None:
        return status, ("Unknown", "NotYetIndexed", "no materialization has written the index yet")
    if outcome == "Succeeded":
        report = _report(result, feast_view) or {}
        status.documents = int(report.get("documents") or 0)
        status.model = report.get("model")
        status.reembed = int(report.get("reembed") or 0)
        status.reembed_needed = False
        by = f", embedded by {status.model}" if status.model else ""
        return status, ("True", "Indexed", f"{status.documents} vectors of {vector.dimension} ({vector.metric}){by}")
    if reason == "ReembedNeeded":
        status.reembed_needed = True
    if reason in VECTOR_REASONS:
        return status, ("False", reason, message or reason)
    return status, ("False", "MaterializationFailed", message or "the materialization failed")
