"""The engine's event stream passed on to the client as bytes, with the facts the front needs read by a byte scan
(pure).

A streamed answer is dozens of small events (one per token step); parsing each as JSON and writing it again cost
the front more CPU than the engine spent making it. The engine (vLLM) writes each event as ``data: <compact
JSON>\\n\\n``; the relay forwards whole events as they arrive and reads from their bytes only:
- whether generated text has begun (time to first token): the first ``"content":"`` (chat) or ``"text":"``
  (completion) followed by anything but the closing quote. Inside a JSON string every quote is escaped, so these
  byte sequences are keys, never text;
- the usage (the token budget and the token metrics): vLLM sends it in a final event of its own (no choices);
  only events that carry ``"usage"`` are parsed, once per stream;
- the end, ``data: [DONE]``.
Changes it makes: the usage event is dropped when the client did not ask for it (the front always asks the
engine), and an adapter version's engine name is put back to the adapter's name the client asked for.
"""

from __future__ import annotations

import json
import re
from typing import Any

EVENT_END = b"\n\n"
DONE = b"data: [DONE]"
_TEXT = re.compile(rb'"(?:content|text)":\s*"[^"]')
_USAGE = b'"usage":'


def _usage_of(doc: dict[str, Any]) -> tuple[int, int] | None:
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _event_doc(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` event; None for [DONE], comments and anything that does not parse."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                doc = json.loads(line[5:])
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None


def events(block: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a block of whole events (what SseRelay returns), in order; [DONE] is not one."""
    docs = []
    for event in block.split(EVENT_END):
        doc = _event_doc(event) if event else None
        if doc is not None:
            docs.append(doc)
    return docs


class SseRelay:
    """Feed it the engine's bytes as they come (``feed``), then ``end``; each returns what the client gets now."""

    def __init__(self, keep_usage: bool, engine_model: str | None = None, client_model: str | None = None) -> None:
        self.keep_usage = keep_usage
        self.text_started = False
        self.usage = (0, 0)
        self.done = False
        self._pending = b""
        self._rename: tuple[re.Pattern[bytes], bytes] | None = None
        if engine_model is not None and client_model is not None and engine_model != client_model:
            engine_name = re.escape(json.dumps(engine_model).encode())
            self._rename = (re.compile(rb'"model":\s*' + engine_name), b'"model":' + json.dumps(client_model).encode())

    def feed(self, data: bytes) -> bytes:
        """The whole events of what arrived so far (an event split across reads waits for its end)."""
        buffer = self._pending + data if self._pending else data
        cut = buffer.rfind(EVENT_END)
        if cut < 0:
            self._pending = buffer
            return b""
        cut += len(EVENT_END)
        self._pending = buffer[cut:]
        return self._scan(buffer[:cut])

    def end(self) -> bytes:
        """What is left when the engine's stream ends: a last event without its blank line, if it is whole."""
        rest, self._pending = self._pending.strip(), b""
        if not rest or (_event_doc(rest) is None and DONE not in rest):
            return b""
        return self._scan(rest + EVENT_END)

    def _scan(self, block: bytes) -> bytes:
        if not self.text_started and _TEXT.search(block):
            self.text_started = True
        if _USAGE in block:
            block = self._take_usage(block)
        if not self.done and DONE in block:
            self.done = True
        if self._rename is not None:
            pattern, name = self._rename
            block = pattern.sub(name, block)
        return block

    def _take_usage(self, block: bytes) -> bytes:
        """Read the usage of the events that carry it; without ``keep_usage`` drop the usage-only event (and, should
        the engine send usage beside choices, remove it from that event)."""
        kept = []
        for event in block.split(EVENT_END)[:-1]:
            doc = _event_doc(event) if _USAGE in event else None
            usage = _usage_of(doc) if doc is not None else None
            if doc is None or usage is None:
                kept.append(event)
                continue
            self.usage = usage
            if self.keep_usage:
                kept.append(event)
            elif doc.get("choices"):
                del doc["usage"]
                kept.append(b"data: " + json.dumps(doc, separators=(",", ":")).encode())
        return b"".join(event + EVENT_END for event in kept)
