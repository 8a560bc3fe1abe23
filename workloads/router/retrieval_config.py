"""The retrieval step's configuration: what a step's ``retrieve`` says, and the vector store it reads, resolved.

A chat step (``protocol: openai-chat``) with ``retrieve`` first embeds the caller's question with the embedding
service of a vector FeatureView, asks the view's Feast feature server for the nearest documents, renders them with
the question into the prompt template, and then calls its own service (a vllm LLM) with that prompt. The step's
``retrieve`` block mirrors the InferenceGraph API (tests/unit/test_contracts.py compares them); where the store and
the embedding service answer comes from the FeatureView's status, resolved by the operator into
``RouterConfig.stores`` (``VectorStoreConfig``), keyed by the FeatureView's name.

Pydantic only: the operator imports it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from loom.workloads.common.config import CamelModel

# What to do when the embedding service or the store cannot answer: answer from the question alone (the response
# says so and names no source), or fail the request with an error naming the step.
OnRetrievalFailure = Literal["AnswerWithoutContext", "Fail"]
# What to do when the question and the documents do not fit the prompt budget together: drop the lowest ranked
# documents and cut the last one kept, or refuse the request (400). A question that alone does not fit is always
# refused.
OnOverflow = Literal["TruncateDocuments", "Refuse"]
FilterOperator = Literal["In", "NotIn"]

QUESTION = "{question}"
CONTEXT = "{context}"
DEFAULT_PROMPT_TEMPLATE = (
    "Answer the question using only the context below. If the context does not contain the answer, say so.\n\n"
    "Context:\n{context}\n\nQuestion: {question}"
)
TopK = Annotated[int, Field(ge=1, le=50, description="How many documents to put into the prompt at most.")]
MinScore = Annotated[
    float,
    Field(
        ge=-1.0, le=1.0,
        description="Documents scoring below are left out (score: 1 - distance for cosine, i.e. the cosine "
        "similarity; 1 / (1 + distance) for the other metrics).",
    ),
]
PromptBudget = Annotated[
    int,
    Field(
        ge=64, le=1_000_000,
        description="Characters the rendered prompt (template, question and documents) may have: keep it below "
        "the LLM's context (about 3 characters a token for English, leaving room for the answer).",
    ),
]
RetrievalTimeout = Annotated[
    int, Field(ge=1, le=600_000, description="Embedding and search together must answer within this (ms).")
]
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class MetadataFilter(CamelModel):
    """Keep a document only if its feature ``field`` is (In) or is not (NotIn) one of ``values``, compared as
    text."""

    field: str = Field(description="A feature of the FeatureView (not the text or the vector).", max_length=63)
    operator: FilterOperator = "In"
    values: list[Annotated[str, Field(max_length=256)]] = Field(min_length=1, max_length=32)

    @field_validator("field")
    @classmethod
    def _check_field(cls, value: str) -> str:
        if not _FIELD.match(value):
            raise ValueError("field must be a feature name: letters, digits and '_', not starting with a digit")
        return value


class RetrieveConfig(CamelModel):
    """A step's retrieval, as the InferenceGraph spec says it (the API mirrors these fields)."""

    feature_view: str = Field(description="The vector FeatureView (same namespace) whose documents are searched.")
    embedding_service: str | None = Field(
        None,
        description="The embedding InferenceService; by default the one the FeatureView embeds its documents with "
        "(another one would compare vectors of two models).",
    )
    top_k: TopK = 4
    min_score: MinScore | None = None
    filters: list[MetadataFilter] = Field(default_factory=list, max_length=8)
    prompt_template: str = Field(
        DEFAULT_PROMPT_TEMPLATE,
        min_length=1, max_length=8192,
        description="The user message sent to the LLM: {question} is the caller's last user message, {context} the "
        "documents. Only these two placeholders are replaced (no other braces are interpreted).",
    )
    prompt_budget_chars: PromptBudget = 8000
    on_overflow: OnOverflow = "TruncateDocuments"
    on_failure: OnRetrievalFailure = "Fail"
    timeout_ms: RetrievalTimeout = 5000

    @model_validator(mode="after")
    def _check_template(self) -> RetrieveConfig:
        for placeholder in (QUESTION, CONTEXT):
            if placeholder not in self.prompt_template:
                raise ValueError(f"promptTemplate must contain {placeholder}")
        return self


class EmbeddingConfig(CamelModel):
    """Where the question is embedded: an OpenAI /v1/embeddings endpoint and the model name it serves."""

    url: str = Field(description="The endpoint, path included, e.g. http://embedder.team.svc:80/v1/embeddings.")
    model_name: str


class VectorStoreConfig(CamelModel):
    """A vector FeatureView as the router reaches it (from its status.vectorSearch)."""

    search_url: str = Field(description="Feast's POST /search of the view's feature server, path included.")
    feature_refs: list[str] = Field(min_length=1, description="<feastView>:<feature> asked for, the text among them.")
    text_field: str = Field(description="The feature holding a document's text.")
    metric: str = Field("cosine", description="The index's distance metric (how a distance becomes a score).")
    embedding: EmbeddingConfig

    @field_validator("search_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+(/\S*)?$", value):
            raise ValueError(f"searchUrl must be an http(s) URL, got {value!r}")
        return value
