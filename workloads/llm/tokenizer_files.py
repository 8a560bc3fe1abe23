"""The tokenizer as this replica's engine uses it, served to the endpoint picker (precise prefix routing): the picker
tokenizes each prompt itself to match the engines' KV-cache events, so it needs the model's `tokenizer.json` and
`tokenizer_config.json` (its chat template). It reads them from a replica (workloads/picker/tokenizer_fetch.py)
instead of fetching the model, which would take the model store's credentials and the whole model's download, and
asks the replicas for their digest (`GET /v2/tokenizer`) now and then to follow a new model's.

Served only when the engine publishes KV events (engine.kvEventsPort), without an API key as the probes and the
adapter states are: the picker holds no key. What it exposes is what a client could reconstruct from the model's
answers anyway (its vocabulary and chat template), never weights. The chat template is the engine's: a template the
spec gives (engine.chatTemplate) replaces the model's, and a template kept beside the config
(`chat_template.jinja`, newer transformers' layout) fills a config that has none.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZER_PATH = "/v2/tokenizer"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG)
# The index (the tokenizer's digest) and each file: the paths served without a key.
PATHS = (TOKENIZER_PATH, *(f"{TOKENIZER_PATH}/{name}" for name in FILES))


def digest(tokenizer_json: bytes, config: bytes | None) -> str:
    """What names a tokenizer as served (both files' bytes): the picker compares its replicas' by it, to follow a
    new model's tokenizer once every replica serves it."""
    hashed = hashlib.sha256(tokenizer_json)
    hashed.update(b"\0")
    hashed.update(config or b"")
    return hashed.hexdigest()


def tokenizer_digest(model_dir: Path, chat_template: str | None) -> str | None:
    tokenizer = tokenizer_file(model_dir, TOKENIZER_JSON, chat_template)
    if tokenizer is None:
        return None
    return digest(tokenizer, tokenizer_file(model_dir, TOKENIZER_CONFIG, chat_template))


def tokenizer_file(model_dir: Path, name: str, chat_template: str | None) -> bytes | None:
    """The bytes to serve for `name` (one of FILES), or None when the model has no such file."""
    if name == TOKENIZER_JSON:
        path = model_dir / TOKENIZER_JSON
        return path.read_bytes() if path.is_file() else None
    if name != TOKENIZER_CONFIG:
        return None
    path = model_dir / TOKENIZER_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else None
    if config is None and chat_template is None:
        return None
    config = config if isinstance(config, dict) else {}
    separate = model_dir / CHAT_TEMPLATE_FILE
    if chat_template is not None:
        config["chat_template"] = chat_template
    elif "chat_template" not in config and separate.is_file():
        config["chat_template"] = separate.read_text()
    return json.dumps(config).encode()
