"""The model's tokenizer for precise prefix routing, read once from a replica's front (workloads/llm/
tokenizer_files.py: `tokenizer.json` and `tokenizer_config.json` as the engine uses them) when the picker's config
names no folder, as when the operator runs it: the picker pod neither fetches the model (the store's credentials,
the whole download) nor asks a replica per request (the tokens are the picker's own work, per request).

Until a replica answers, the picker routes by its estimate; the replicas are tried in turn, every `interval_s` at
first, then less often (a model without `tokenizer.json`, say one with only a sentencepiece `tokenizer.model`, is
never answered: the picker keeps its estimate, and says why once per replica rather than twice a second).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from loom.workloads.llm.tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_JSON, TOKENIZER_PATH

from .prompt_tokens import PromptTokenizer

log = logging.getLogger("loom.workloads.picker")

TIMEOUT_S = 30.0  # a large vocabulary is megabytes; the replica is on the pod network
MAX_INTERVAL_S = 60.0


async def read_tokenizer(session: aiohttp.ClientSession, endpoint: str) -> tuple[str, dict[str, Any]]:
    """The two files' contents from the front at `endpoint` (ip:port); raises on any failure or a 404 of
    tokenizer.json (a config the model lacks reads as empty)."""
    base = f"http://{endpoint}{TOKENIZER_PATH}"
    async with session.get(f"{base}/{TOKENIZER_JSON}") as answer:
        answer.raise_for_status()
        tokenizer_json = await answer.text()
    async with session.get(f"{base}/{TOKENIZER_CONFIG}") as answer:
        if answer.status == 404:
            return tokenizer_json, {}
        answer.raise_for_status()
        config = json.loads(await answer.text())
    if not isinstance(config, dict):
        raise ValueError(f"{TOKENIZER_CONFIG} of {endpoint} is not a JSON object")
    return tokenizer_json, config


async def tokenizer_from_replicas(endpoints: Callable[[], Iterable[str]], interval_s: float,
                                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> PromptTokenizer:
    """The first tokenizer a replica serves, trying the replicas listed now in turn, waiting `interval_s` after a
    round where none answered (no replica yet), twice as long after each round where every one failed."""
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    told: set[str] = set()
    wait_s = interval_s
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            listed = sorted(endpoints())
            for endpoint in listed:
                try:
                    tokenizer_json, config = await read_tokenizer(session, endpoint)
                    tokenizer = await asyncio.to_thread(PromptTokenizer, tokenizer_json, config)
                except Exception as exc:  # unreachable, an HTTP error, or files the tokenizers library refuses
                    log.log(logging.DEBUG if endpoint in told else logging.WARNING,
                            "no tokenizer from %s (routing by the estimate meanwhile): %s", endpoint, exc)
                    told.add(endpoint)
                    continue
                log.info("tokenizer read from %s: precise prefix routing on", endpoint)
                return tokenizer
            await sleep(wait_s)
            # No replica listed yet: look again soon; every listed one failed: less often each round.
            wait_s = min(MAX_INTERVAL_S, wait_s * 2) if listed else interval_s
