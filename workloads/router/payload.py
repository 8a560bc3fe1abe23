"""Bodies flowing through a graph, and the few places the router has to rewrite them.

A body stays the bytes it arrived as wherever possible: the graph's request is sent to every
``$request`` step unchanged (JSON or the binary tensor extension), and the last step's response is
answered unchanged. JSON is parsed lazily (once) only when a condition reads it, when a 200 might
carry an error, or when a body must change shape:

- ``$response`` into a service (chaining): an OIP response is not an OIP request, so ``outputs``
  become ``inputs`` (names, datatypes, shapes, data and binary tails kept; ``id`` and ``parameters``
  kept). For generate, ``text_output`` becomes ``text_input`` with the graph request's parameters.
  A body of any other shape is sent as it is.
- Ensemble: one OIP response whose outputs are every step's outputs renamed ``<step>/<output>``
  (see :func:`combine_infer`); for generate ``{"model_name", "text_outputs": {step: text}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

HEADER_LENGTH = "inference-header-content-length"
Origin = Literal["request", "response"]
Endpoint = Literal["infer", "generate", "chat"]  # chat: OpenAI /v1/chat/completions (openai_chat.py)
_UNSET: Any = object()


class PayloadError(ValueError):
    """A body the router needed to read is not what the protocol says it is."""


@dataclass(eq=False)
class Payload:
    """One body: the bytes, how they are framed, and whether a model produced them."""

    body: bytes
    content_type: str = "application/json"
    # Binary tensor extension: the JSON header's length; the tensors' bytes follow it.
    header_length: int | None = None
    origin: Origin = "request"
    _doc: Any = field(default=_UNSET, repr=False)

    def doc(self) -> Any:
        """The JSON document (the header part under the binary extension), parsed once."""
        if self._doc is _UNSET:
            head = self.body if self.header_length is None else self.body[: self.header_length]
            try:
                self._doc = json.loads(head)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise PayloadError(f"body is not valid JSON: {exc}") from exc
            except RecursionError as exc:  # nesting deeper than the parser's stack: a client error
                raise PayloadError("body is nested too deeply") from exc
        return self._doc

    @property
    def tail(self) -> bytes:
        """The binary tensor bytes after the JSON header (empty without the extension)."""
        return b"" if self.header_length is None else self.body[self.header_length :]

    def http_headers(self) -> dict[str, str]:
        headers = {"content-type": self.content_type}
        if self.header_length is not None:
            headers[HEADER_LENGTH] = str(self.header_length)
        return headers

    @classmethod
    def from_http(cls, body: bytes, headers: Any, origin: Origin) -> Payload:
        """From an HTTP message's body and headers (any mapping with ``get``)."""
        raw_length = headers.get(HEADER_LENGTH)
        try:
            length = None if raw_length is None else int(raw_length)
        except ValueError as exc:
            raise PayloadError("Inference-Header-Content-Length must be an integer") from exc
        if length is not None and not 0 <= length <= len(body):
            raise PayloadError("Inference-Header-Content-Length exceeds the body")
        content_type = headers.get("content-type") or "application/json"
        return cls(body, content_type, length, origin)

    @classmethod
    def from_doc(cls, doc: Any, tail: bytes = b"", origin: Origin = "response") -> Payload:
        head = json.dumps(doc, separators=(",", ":")).encode()
        if not tail:
            return cls(head, "application/json", None, origin, doc)
        return cls(head + tail, "application/octet-stream", len(head), origin, doc)


def error_message(payload: Payload) -> str | None:
    """The message when a body is an error document (``{"error": ...}``), else None.

    Cheap for the common case: the JSON is parsed only when the bytes mention "error".
    """
    head = payload.body if payload.header_length is None else payload.body[: payload.header_length]
    if b'"error"' not in head:
        return None
    try:
        doc = payload.doc()
    except PayloadError:
        return None
    if isinstance(doc, dict) and "error" in doc:
        value = doc["error"]
        return value if isinstance(value, str) else json.dumps(value)
    return None


def as_request(payload: Payload, endpoint: Endpoint, graph_request: Payload) -> Payload:
    """The body to send to a service: a request as it is, a model's response chained (see module doc)."""
    if payload.origin == "request":
        return payload
    try:
        doc = payload.doc()
    except PayloadError:
        return payload
    if not isinstance(doc, dict):
        return payload
    if endpoint == "generate":
        text = doc.get("text_output")
        if not isinstance(text, str):
            return payload
        chained: dict[str, Any] = {"text_input": text}
        try:
            original = graph_request.doc()
        except PayloadError:
            original = None
        if isinstance(original, dict) and isinstance(original.get("parameters"), dict):
            chained["parameters"] = original["parameters"]
        if isinstance(doc.get("id"), str):
            chained["id"] = doc["id"]
        return Payload.from_doc(chained, origin="request")
    outputs = doc.get("outputs")
    if not isinstance(outputs, list):
        return payload
    request: dict[str, Any] = {"inputs": outputs}
    for key in ("id", "parameters"):
        if key in doc:
            request[key] = doc[key]
    return Payload.from_doc(request, payload.tail, origin="request")


def _binary_size(entry: dict[str, Any]) -> int | None:
    params = entry.get("parameters")
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    return size if isinstance(size, int) else None


def combine_infer(graph: str, request_id: str | None, results: list[tuple[str, Payload]]) -> Payload:
    """An Ensemble's OIP response: every step's outputs, each renamed ``<step>/<output>``, in step order.

    Binary tensors stay binary (their bytes are carried over in the same order).
    """
    outputs: list[dict[str, Any]] = []
    tails: list[bytes] = []
    for step, payload in results:
        doc = payload.doc()
        if not isinstance(doc, dict) or not isinstance(doc.get("outputs"), list):
            raise PayloadError(f"step {step!r} answered without an 'outputs' list")
        tail = payload.tail
        offset = 0
        for entry in doc["outputs"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise PayloadError(f"step {step!r} answered an output without a name")
            outputs.append({**entry, "name": f"{step}/{entry['name']}"})
            size = _binary_size(entry)
            if size is not None:
                if offset + size > len(tail):
                    raise PayloadError(f"step {step!r}: binary_data_size does not fit its body")
                tails.append(tail[offset : offset + size])
                offset += size
    combined: dict[str, Any] = {"model_name": graph}
    if request_id is not None:
        combined["id"] = request_id
    combined["outputs"] = outputs
    return Payload.from_doc(combined, b"".join(tails))


def combine_generate(graph: str, request_id: str | None, results: list[tuple[str, Payload]]) -> Payload:
    """An Ensemble's generate response: ``{"model_name": graph, "text_outputs": {step: text}}``."""
    texts: dict[str, str] = {}
    for step, payload in results:
        doc = payload.doc()
        if not isinstance(doc, dict) or not isinstance(doc.get("text_output"), str):
            raise PayloadError(f"step {step!r} answered without a string 'text_output'")
        texts[step] = doc["text_output"]
    combined: dict[str, Any] = {"model_name": graph}
    if request_id is not None:
        combined["id"] = request_id
    combined["text_outputs"] = texts
    return Payload.from_doc(combined)


def request_id(payload: Payload) -> str | None:
    try:
        doc = payload.doc()
    except PayloadError:
        return None
    value = doc.get("id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None
