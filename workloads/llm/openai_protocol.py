"""The OpenAI-compatible API as pure functions: request checks, the body sent to the engine, usage, errors,
SSE framing, and the OIP v2 generate extension mapped onto a completion.

Nothing here does I/O or knows vLLM (engine.py does). Requests are checked here, before the engine sees
them, so every runtime error a client gets is OpenAI-shaped (``{"error": {"message", "type", "code"}}``),
and the front knows ``max_tokens`` and the stream options it needs for its limits and metrics. Fields this
module does not check (vLLM's sampling extras such as ``top_k`` or ``ignore_eos``) pass through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from loom.workloads.server.protocol import GenerateRequest, GenerateResponse

Kind = Literal["completion", "chat"]
MAX_N = 16
MAX_STOP = 4
# Generate-extension parameters that mean the same as a completion's; others pass through as they are.
_GENERATE_ALIASES = {"max_new_tokens": "max_tokens"}

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    502: "server_error", 503: "service_unavailable", 504: "timeout_error",
}


class OpenAIError(Exception):
    """An error as OpenAI clients expect it; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Codes of the refusals the shared body limit answers before any route runs (loom.workloads.common.body_limit).
_BODY_LIMIT_CODES = {400: "invalid_content_length", 408: "request_body_timeout", 413: "request_too_large"}


def body_limit_error(status: int, message: str) -> bytes:
    """The body limit's refusals (413 too large, 408 too slow, 400 a bad Content-Length) in OpenAI's error shape,
    as every other answer of the front."""
    error = OpenAIError(status, message, _BODY_LIMIT_CODES.get(status, "invalid_request"))
    return json.dumps(error.body()).encode()


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code, param)


@dataclass(frozen=True)
class LlmRequest:
    """A checked request: what goes to the engine and what the front must know about it."""

    kind: Kind
    engine_body: dict[str, Any]
    stream: bool
    include_usage: bool  # whether the client asked for the usage chunk (the engine is always asked)
    max_tokens: int
    n: int


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(doc, dict):
        raise invalid("the body must be a JSON object", code="invalid_json")
    return doc


def _number(doc: dict[str, Any], name: str, low: float, high: float, integer: bool = False) -> None:
    value = doc.get(name)
    if value is None:
        return
    number = isinstance(value, int) or (not integer and isinstance(value, float))
    if isinstance(value, bool) or not number or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise invalid(f"'{name}' must be {what} between {low:g} and {high:g}, not {value!r}", name)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        content = message.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise invalid(f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and (
        all(isinstance(p, str) for p in prompt) or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
    ):
        return
    raise invalid("'prompt' must be a string, a list of strings or a list of token ids", "prompt")


def parse_request(kind: Kind, body: bytes, served_model: str, max_tokens_limit: int,
                  default_max_tokens: int = 16, adapters: Collection[str] = ()) -> LlmRequest:
    """Check a /v1/completions or /v1/chat/completions body and build the engine's copy of it. ``model`` is the
    served model or one of its LoRA ``adapters``."""
    doc = _json_object(body)
    model = doc.get("model")
    if not isinstance(model, str):
        raise invalid("'model' is required (a string)", "model", "missing_model")
    if model != served_model and model not in adapters:
        also = f" and the adapters {', '.join(sorted(adapters))}" if adapters else ""
        raise OpenAIError(404, f"the model '{model}' does not exist; this service serves '{served_model}'{also}",
                          "model_not_found", "model")
    if kind == "chat":
        _check_messages(doc.get("messages"))
    else:
        _check_prompt(doc.get("prompt"))
    # Chat's newer name for max_tokens; either is accepted, the engine gets max_tokens.
    limit_name = "max_completion_tokens" if doc.get("max_completion_tokens") is not None else "max_tokens"
    _number(doc, limit_name, 1, max_tokens_limit, integer=True)
    _number(doc, "n", 1, MAX_N, integer=True)
    _number(doc, "temperature", 0, 2)
    _number(doc, "top_p", 0, 1)
    _number(doc, "seed", -(2**63), 2**63 - 1, integer=True)
    if doc.get("top_p") == 0:
        raise invalid("'top_p' must be greater than 0", "top_p")
    stop = doc.get("stop")
    stop_list = isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop)
    if stop is not None and not (isinstance(stop, str) or stop_list):
        raise invalid(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    options = doc.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise invalid("'stream_options' must be an object, and only with stream: true", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    max_tokens = int(doc.get(limit_name) or default_max_tokens)
    engine_body = {k: v for k, v in doc.items() if k != "max_completion_tokens"}
    engine_body["max_tokens"] = max_tokens
    if stream:
        # Always ask the engine for usage: the token budget and the token metrics need it.
        engine_body["stream_options"] = {**(options or {}), "include_usage": True}
    return LlmRequest(kind, engine_body, stream, include_usage, max_tokens, int(doc.get("n") or 1))


def usage_tokens(doc: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens from an OpenAI response or final stream chunk; (0, 0) without usage."""
    usage = doc.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def engine_error(status: int, body: bytes) -> OpenAIError:
    """The engine's error answer as an OpenAIError: vLLM writes ``{"error": {...}}`` (or, in older versions,
    the fields at the top level); anything else keeps the status with a generic message."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = {}
    inner = doc.get("error") if isinstance(doc, dict) and isinstance(doc.get("error"), dict) else doc
    if not isinstance(inner, dict):
        inner = {}
    message = str(inner.get("message") or f"the engine answered {status}")
    code, param = inner.get("code"), inner.get("param")
    return OpenAIError(status if 400 <= status < 600 else 502, message,
                       code if isinstance(code, str) else None, param if isinstance(param, str) else None)


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event; a string is sent as it is (``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a stream chunk adds (completion ``text`` or chat ``delta.content``), over its choices."""
    pieces = []
    for choice in chunk.get("choices") or []:
        if isinstance(choice.get("text"), str):
            pieces.append(choice["text"])
        delta = choice.get("delta") or {}
        if isinstance(delta.get("content"), str):
            pieces.append(delta["content"])
    return "".join(pieces)


def generate_to_completion(request: GenerateRequest, served_model: str, stream: bool) -> bytes:
    """The OIP generate extension's request as a /v1/completions body for the same model."""
    params = {_GENERATE_ALIASES.get(k, k): v for k, v in request.parameters.items()}
    body: dict[str, Any] = {**params, "model": served_model, "prompt": request.text_input, "stream": stream}
    return json.dumps(body).encode()


def completion_to_generate(doc: dict[str, Any], served_model: str, request_id: str | None) -> GenerateResponse:
    """A completion (or one streamed chunk) as a generate answer."""
    return GenerateResponse(served_model, None, chunk_text(doc), request_id)
