"""`spec.vector` and `status.vectorSearch` of a FeatureView: a vector field indexed for search, and the embedding
service that fills it (models only; the workload does the work: loom.workloads.features.vector_store, embedding).

The CEL rules here sit on FeatureViewSpec (they compare spec.vector with the view's features, entities and store).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ....core.model import ApiModel, SecretKeySelector, cel, validations

IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"


class Chunking(ApiModel):
    """How a document is cut before embedding: windows of `size` characters sharing `overlap` characters (a cut moves
    back to the last whitespace when there is one)."""

    model_config = validations(
        cel("self.overlap < self.size", "chunking.overlap must be smaller than chunking.size", field_path=".overlap"),
    )

    size: int = Field(1000, ge=16, le=100_000, description="Characters per chunk.")
    overlap: int = Field(100, ge=0, le=50_000, description="Characters shared by consecutive chunks.")


class Embedding(ApiModel):
    """The view's documents are embedded during materialization by an InferenceService serving an embedding model
    on the OpenAI `/v1/embeddings` API (the vllm runtime with a pooling model). The source then holds documents
    (an id and a text column); each is cut into chunks, and each chunk becomes a row: the entity (one String join
    key) is `<document id>#<n>`, `vector.textField` the chunk's text, `vector.field` its embedding, and every other
    feature is copied from the document's row (metadata to filter on)."""

    service: str = Field(
        min_length=1, max_length=63, description="The InferenceService (same namespace) serving the embedding model."
    )
    model: str = Field(min_length=1, max_length=253, description="The model name the service serves.")
    document_column: str = Field("document_id", max_length=63, pattern=IDENTIFIER, description="Document id column.")
    text_column: str = Field("text", max_length=63, pattern=IDENTIFIER, description="Document text column.")
    chunking: Chunking = Field(default_factory=Chunking)
    batch_size: int = Field(32, ge=1, le=2048, description="Chunks per embeddings request.")
    api_key_secret_ref: SecretKeySelector | None = Field(
        None, description="Secret key holding an API key of the service (when its spec.auth asks for one)."
    )
    reembed: int = Field(
        0,
        ge=0,
        description="Re-embedding generation. The index records the model that embedded it; when the service's "
        "model changes, materialization stops (condition VectorIndex, reason ReembedNeeded) until this is raised "
        "above status.vectorSearch.reembed, and then re-embeds every document with the new model.",
    )


class VectorSearch(ApiModel):
    """A vector field indexed for nearest-neighbour search (sqlite-vec on the sqlite online store), queried through
    the feature server's `POST /search` (Feast's API)."""

    field: str = Field(
        min_length=1, max_length=63, pattern=IDENTIFIER, description="The Array(Float32) feature holding vectors."
    )
    dimension: int = Field(ge=1, le=8192, description="Length of every vector (the embedding model's output).")
    metric: Literal["cosine", "l2", "l1"] = Field("cosine", description="Distance of the search.")
    text_field: str | None = Field(
        None, max_length=63, pattern=IDENTIFIER, description="The String feature holding the document's text."
    )
    embedding: Embedding | None = Field(
        None, description="Embed the source's documents during materialization (no precomputed vectors)."
    )


VECTOR_RULES = (
    cel(
        "!has(self.vector) || self.features.exists(f, f.name == self.vector.field && f.dtype == 'Array(Float32)')",
        "vector.field must name a feature of dtype Array(Float32)",
        field_path=".vector.field",
    ),
    cel(
        "!has(self.vector) || !has(self.vector.textField) || "
        "self.features.exists(f, f.name == self.vector.textField && f.dtype == 'String')",
        "vector.textField must name a feature of dtype String",
        field_path=".vector.textField",
    ),
    cel(
        "!has(self.vector) || !has(self.store) || !has(self.store.online) || !has(self.store.online.type) || "
        "self.store.online.type == 'sqlite'",
        "vector search runs on the sqlite online store (sqlite-vec)",
        field_path=".store.online.type",
    ),
    cel(
        "!has(self.vector) || !has(self.vector.embedding) || has(self.vector.textField)",
        "an embedded view needs vector.textField (where each chunk's text goes)",
        field_path=".vector.textField",
    ),
    cel(
        "!has(self.vector) || !has(self.vector.embedding) || "
        "(size(self.entities) == 1 && has(self.entities[0].valueType) && self.entities[0].valueType == 'String')",
        "an embedded view has one entity of valueType String: the chunk id <document id>#<n>",
        field_path=".entities",
    ),
)



class EmbeddingStatus(ApiModel):
    service: str | None = Field(None, description="The InferenceService embedding the documents.")
    url: str | None = Field(None, description="Its OpenAI embeddings endpoint (POST; embed questions here too).")
    model: str | None = Field(None, description="The model name to send.")


class VectorSearchStatus(ApiModel):
    """Where and how to search the view's vectors (what a retrieval step reads)."""

    url: str | None = Field(None, description="POST <url>/search (Feast's API, api_version 2) with the query vector.")
    feature_refs: list[str] | None = Field(None, description="Features a search may return (<feastView>:<feature>).")
    field: str | None = None
    text_field: str | None = None
    dimension: int | None = None
    metric: str | None = None
    documents: int | None = Field(None, description="Vectors in the index after the last materialization.")
    model: str | None = Field(None, description="The embedding model whose vectors the index holds.")
    reembed: int | None = Field(None, description="The re-embedding generation that built the index.")
    reembed_needed: bool = Field(False, description="The service's model differs from the index's: raise reembed.")
    embedding: EmbeddingStatus | None = None
