"""The retrieval step, over a :class:`Retriever` (the network: retrieval_io.py; a fake in unit tests).

For a chat request bound to a step with ``retrieve``: take the question (the last user message), refuse it if it
does not fit the prompt budget even without documents, embed it, search the FeatureView's store, keep the documents
that pass the filters and the score threshold, render them with the question into the template and put that prompt
in place of the last user message. What was used comes back as :class:`Retrieval` (the response names it).

When embedding or search fails (unreachable, an error answer, a malformed answer, the retrieval timeout):
``onFailure: Fail`` raises :class:`RetrievalFailed` (the engine answers 502/504 naming the step);
``AnswerWithoutContext`` goes on with the template's context saying that none could be retrieved, and
:attr:`Retrieval.degraded` says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .prompt import build_prompt, check_question, question_of, with_prompt, without_context
from .retrieval_config import RetrieveConfig, VectorStoreConfig
from .sources import Source, StoreAnswerError, candidates, parse_search, select


class RetrievalUnavailable(Exception):
    """The embedding service or the store could not answer (unreachable, an error status, a malformed body)."""


class RetrievalFailed(Exception):
    """Retrieval failed and the step is configured to fail (``onFailure: Fail``)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.message = message
        self.timed_out = timed_out


class Retriever(Protocol):
    """What the retrieval step needs from the network. Both raise :class:`RetrievalUnavailable`."""

    async def embed(self, store: VectorStoreConfig, text: str, headers: Mapping[str, str]) -> list[float]: ...

    async def search(
        self, store: VectorStoreConfig, vector: list[float], top_k: int, headers: Mapping[str, str]
    ) -> Any: ...


@dataclass
class Retrieval:
    """What one retrieval step did: the documents in the prompt, how many the store returned, and (when it
    answered without context) why."""

    sources: list[Source] = field(default_factory=list)
    returned: int = 0
    degraded: str | None = None


@dataclass(frozen=True)
class Augmented:
    request: dict[str, Any]
    retrieval: Retrieval


async def augment(
    doc: dict[str, Any],
    spec: RetrieveConfig,
    store: VectorStoreConfig,
    retriever: Retriever,
    headers: Mapping[str, str],
    timeout_s: float,
) -> Augmented:
    """The chat request ``doc`` with the retrieved documents in its prompt (see the module doc).

    Raises :class:`prompt.PromptError` for a request that cannot be answered (no question, too long) and
    :class:`RetrievalFailed` when retrieval failed under ``onFailure: Fail``."""
    question = question_of(doc)
    check_question(spec.prompt_template, question, spec.prompt_budget_chars)
    try:
        async with asyncio.timeout(timeout_s):
            vector = await retriever.embed(store, question, headers)
            answer = await retriever.search(store, vector, candidates(spec.top_k, spec.filters), headers)
        documents = parse_search(answer, store.feature_refs, store.text_field, store.metric)
    except (RetrievalUnavailable, StoreAnswerError, TimeoutError) as exc:
        timed_out = isinstance(exc, TimeoutError)
        reason = f"retrieval took longer than {timeout_s * 1000:.0f} ms" if timed_out else str(exc)
        if spec.on_failure == "Fail":
            raise RetrievalFailed(reason, timed_out) from exc
        bare = without_context(spec.prompt_template, question)
        return Augmented(with_prompt(doc, bare), Retrieval(degraded=reason))
    chosen = select(documents, spec.top_k, spec.min_score, spec.filters)
    prompt = build_prompt(spec.prompt_template, question, chosen, spec.prompt_budget_chars, spec.on_overflow)
    return Augmented(with_prompt(doc, prompt.text), Retrieval(prompt.sources, len(documents)))
