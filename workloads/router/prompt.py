"""The retrieval step's prompt: the question taken from a chat request, the documents rendered into the template
within a character budget, and the chat request rewritten with that prompt. Pure functions.

The template is filled in one pass over its own text: only ``{question}`` and ``{context}`` are replaced, every
other brace stays as written, and text coming from the caller or the documents is never read as a placeholder (a
question containing ``{context}`` stays that text). No format-string machinery runs on user input.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .retrieval_config import CONTEXT, QUESTION, OnOverflow
from .sources import Document, Source

_PLACEHOLDER = re.compile(re.escape(QUESTION) + "|" + re.escape(CONTEXT))
SEPARATOR = "\n\n"


class PromptError(ValueError):
    """The request cannot be turned into a prompt; ``code`` says why (the HTTP layer answers 400)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Prompt:
    text: str
    sources: list[Source]


def question_of(doc: dict[str, Any]) -> str:
    """The caller's question: the text of the last user message (string content, or its text parts joined)."""
    messages = doc.get("messages")
    if not isinstance(messages, list):
        raise PromptError("bad_request", "a chat request needs messages")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                text = content
            elif isinstance(content, list):
                parts = [part for part in content if isinstance(part, dict) and part.get("type") == "text"]
                text = "\n".join(str(part.get("text", "")) for part in parts)
            else:
                text = ""
            if text.strip():
                return text
            break
    raise PromptError("no_question", "the retrieval step needs a last user message with text (the question)")


def fill(template: str, question: str, context: str) -> str:
    """The template with its placeholders replaced, in one pass (see the module doc)."""
    values = {QUESTION: question, CONTEXT: context}
    return _PLACEHOLDER.sub(lambda match: values[match.group(0)], template)


def block(number: int, document: Document, text: str) -> str:
    return f"[{number}] (source: {document.id})\n{text}"


def check_question(template: str, question: str, budget: int) -> int:
    """The prompt's length without documents; a PromptError (``question_too_long``) when that is over budget."""
    base = len(fill(template, question, ""))
    if base > budget:
        raise PromptError(
            "question_too_long",
            f"the question makes a prompt of {base} characters, over the retrieval step's budget of {budget} "
            "(retrieve.promptBudgetChars): shorten the question",
        )
    return base


def build_prompt(
    template: str, question: str, documents: Sequence[Document], budget: int, on_overflow: OnOverflow
) -> Prompt:
    """The prompt for ``question`` with as many ``documents`` (nearest first) as fit in ``budget`` characters.

    A question that does not fit with the template alone is refused (``question_too_long``); documents that do
    not fit are dropped from the lowest ranked, the last one kept cut to the room left (``TruncateDocuments``),
    or the request is refused (``Refuse``: ``context_too_long``)."""
    base = check_question(template, question, budget)
    repeats = max(template.count(CONTEXT), 1)
    room = (budget - base) // repeats
    blocks: list[str] = []
    sources: list[Source] = []
    used = 0
    for number, document in enumerate(documents, start=1):
        separator = len(SEPARATOR) if blocks else 0
        whole = block(number, document, document.text)
        if used + separator + len(whole) <= room:
            blocks.append(whole)
            sources.append(Source(document.id, document.score))
            used += separator + len(whole)
            continue
        if on_overflow == "Refuse":
            total = base + (used + separator + len(whole)) * repeats
            raise PromptError(
                "context_too_long",
                f"the question and the retrieved documents make a prompt of at least {total} characters, over the "
                f"retrieval step's budget of {budget} (retrieve.promptBudgetChars; onOverflow is Refuse)",
            )
        left = room - used - separator - len(block(number, document, ""))
        if left > 0:
            blocks.append(block(number, document, document.text[:left]))
            sources.append(Source(document.id, document.score, truncated=True))
        break
    return Prompt(fill(template, question, SEPARATOR.join(blocks)), sources)


def without_context(template: str, question: str) -> str:
    """The prompt when retrieval failed and the step answers anyway: the template with an empty context."""
    return fill(template, question, "(no documents could be retrieved)")


def with_prompt(doc: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The chat request with its last user message replaced by ``prompt`` (every other message kept)."""
    messages = list(doc.get("messages") or [])
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "user":
            messages[index] = {**message, "content": prompt}
            break
    return {**doc, "messages": messages}
