"""The OpenAI chat side of a graph (steps with ``protocol: openai-chat``): bodies and errors, pure functions.

Chaining (a Sequence, or ``data: $response``): a step's chat completion becomes the next step's request as
the graph's request with ``messages`` replaced by one user message, the assistant message's content. So each
step sees the previous step's answer as its prompt (the generate chain's ``text_output`` -> ``text_input``),
and the caller's sampling fields (``temperature``, ``max_tokens``, ``stop``...) apply to every step. ``model``
is always set to the step's served model name: the caller names the graph, each service serves its own.
Only the step in the last position streams; the others are called with ``stream: false``.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` plus Loom's ``graph``, ``node``,
``step``, ``service`` and ``steps`` (extra keys OpenAI clients ignore); mid-stream, as an SSE ``data:`` event
followed by ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import GraphError
from .payload import Payload, PayloadError

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
    504: "timeout_error",
}
DONE = b"data: [DONE]\n\n"


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": None, "code": code, **(extra or {})}}


def graph_error_body(exc: GraphError, graph: str) -> dict[str, Any]:
    """A GraphError in OpenAI's shape, Loom's details (which node and step, upstream status) beside."""
    details = exc.to_json(graph)
    message = details.pop("error")
    code = details.pop("code")
    return error_body(exc.status, message, code, details)


def sse(doc: Any) -> bytes:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()


def check_request(payload: Payload) -> dict[str, Any]:
    """The graph's chat request as a document; a GraphError (400) when it is not one."""
    try:
        doc = payload.doc()
    except PayloadError as exc:
        raise GraphError("bad_request", 400, str(exc)) from exc
    if not isinstance(doc, dict):
        raise GraphError("bad_request", 400, "a chat completion request is a JSON object")
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GraphError("bad_request", 400, "'messages' must be a non-empty list")
    return doc


def assistant_content(doc: Any) -> str | None:
    """The first choice's assistant message content of a chat completion, or None when it has none."""
    if not isinstance(doc, dict):
        return None
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


def chat_request(data: Payload, graph_request: Payload, model: str, stream: bool) -> Payload:
    """The body a step sends: the graph's request (or a chained answer, see the module doc) for ``model``."""
    base = graph_request.doc()
    doc: dict[str, Any] = dict(base) if isinstance(base, dict) else {}
    if data.origin == "response":
        try:
            content = assistant_content(data.doc())
        except PayloadError as exc:
            raise GraphError("bad_upstream_response", 502, f"a chat step answered no JSON: {exc}") from exc
        if content is None:
            raise GraphError(
                "bad_upstream_response", 502, "a chat step answered no choices[0].message.content to pass on"
            )
        doc["messages"] = [{"role": "user", "content": content}]
    doc["model"] = model
    doc["stream"] = stream
    if not stream:
        doc.pop("stream_options", None)  # OpenAI refuses stream_options without stream
    return Payload.from_doc(doc, origin="request")


def completion_as_chunk(payload: Payload) -> bytes:
    """A complete chat completion (the last position was skipped) as one ``chat.completion.chunk`` event."""
    try:
        doc = payload.doc()
    except PayloadError:
        doc = {}
    content = assistant_content(doc) or ""
    chunk = {
        "id": doc.get("id", "chatcmpl-graph") if isinstance(doc, dict) else "chatcmpl-graph",
        "object": "chat.completion.chunk",
        "created": doc.get("created", 0) if isinstance(doc, dict) else 0,
        "model": doc.get("model", "") if isinstance(doc, dict) else "",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }
    return sse(chunk)
