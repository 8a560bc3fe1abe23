"""A request's prompt as the engine's token ids, for precise prefix routing (kv_events.py): the model's tokenizer
(`tokenizer.json`, the `tokenizers` library) and its chat template (`tokenizer_config.json`, rendered with Jinja as
transformers renders it for vLLM), read from the model's folder.

The engine tokenizes a chat request by rendering the template (with the generation prompt) and encoding the text
without special tokens, and a completion's prompt with them; the same here, so a shared prefix of messages gives
the same leading tokens, hence the same block keys, as in the engine. A request the picker cannot render (an
unknown content shape, a template error) has no tokens: it is routed by the estimate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("loom.workloads.picker")

MAX_PROMPT_CHARS = 1_000_000  # longer prompts are not tokenized here (bounds the picker's work per request)


class PromptTokenizer:
    """From the text of `tokenizer.json` and the parsed `tokenizer_config.json` (as a replica's front serves them:
    workloads/llm/tokenizer_files.py), or from the model's folder (`from_folder`)."""

    def __init__(self, tokenizer_json: str, config: Mapping[str, Any]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        self._template = environment.from_string(template) if isinstance(template, str) else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptTokenizer:
        folder = Path(folder)
        config_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        return cls((folder / "tokenizer.json").read_text(), config)

    def tokens(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if self._template is None or not isinstance(messages, list):
                return None
            try:
                text = self._template.render(messages=messages, add_generation_prompt=True, tools=None,
                                             **self._special)
            except Exception as exc:  # a template may raise anything on a message it does not expect
                log.debug("chat template failed on a request: %s", exc)
                return None
            return self._encode(text, special=False)
        if path.endswith("/completions"):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]
            return self._encode(prompt, special=True) if isinstance(prompt, str) else None
        return None

    def _encode(self, text: str, special: bool) -> list[int] | None:
        if len(text) > MAX_PROMPT_CHARS:
            return None
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)


def _token_text(value: object) -> str:
    if isinstance(value, Mapping):  # {"content": "<s>", ...} (an AddedToken as transformers saves it)
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise ValueError(message)
