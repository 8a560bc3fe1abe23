"""The model's tokenizer for precise prefix routing, read from a replica's front (workloads/llm/
tokenizer_files.py: `tokenizer.json` and `tokenizer_config.json` as the engine uses them) when the picker's config
names no folder, as when the operator runs it: the picker pod neither fetches the model (the store's credentials,
the whole download) nor asks a replica per request (the tokens are the picker's own work, per request).

Until a replica answers, the picker routes by its estimate; the replicas are tried in turn, every `interval_s` at
first, then less often (a model without `tokenizer.json`, say one with only a sentencepiece `tokenizer.model`, is
never answered: the picker keeps its estimate, and says why once per replica rather than twice a second).

A new model (spec.model changed) may bring another tokenizer: the picker asks its replicas for their tokenizer's
digest every `check_s` and takes the new one once every replica that answers serves it (the rollout done), so the
prompts' tokens keep matching what the engines report.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from loom.workloads.llm.tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_JSON, TOKENIZER_PATH, digest

from .prompt_tokens import PromptTokenizer

log = logging.getLogger("loom.workloads.picker")

TIMEOUT_S = 30.0  # a large vocabulary is megabytes; the replica is on the pod network
MAX_INTERVAL_S = 60.0
CHECK_S = 60.0
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class Fetched:
    tokenizer: PromptTokenizer
    digest: str


async def read_tokenizer(session: aiohttp.ClientSession, endpoint: str) -> Fetched:
    """The tokenizer the front at `endpoint` (ip:port) serves; raises on any failure or a 404 of tokenizer.json (a
    config the model lacks reads as empty)."""
    base = f"http://{endpoint}{TOKENIZER_PATH}"
    async with session.get(f"{base}/{TOKENIZER_JSON}") as answer:
        answer.raise_for_status()
        tokenizer_json = await answer.read()
    async with session.get(f"{base}/{TOKENIZER_CONFIG}") as answer:
        if answer.status == 404:
            config_bytes = None
        else:
            answer.raise_for_status()
            config_bytes = await answer.read()
    config = json.loads(config_bytes) if config_bytes is not None else {}
    if not isinstance(config, dict):
        raise ValueError(f"{TOKENIZER_CONFIG} of {endpoint} is not a JSON object")
    tokenizer = await asyncio.to_thread(PromptTokenizer, tokenizer_json.decode(), config)
    return Fetched(tokenizer, digest(tokenizer_json, config_bytes))


async def tokenizer_from_replicas(endpoints: Callable[[], Iterable[str]], interval_s: float,
                                  sleep: Sleep = asyncio.sleep) -> Fetched:
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
                    fetched = await read_tokenizer(session, endpoint)
                except Exception as exc:  # unreachable, an HTTP error, or files the tokenizers library refuses
                    log.log(logging.DEBUG if endpoint in told else logging.WARNING,
                            "no tokenizer from %s (routing by the estimate meanwhile): %s", endpoint, exc)
                    told.add(endpoint)
                    continue
                log.info("tokenizer read from %s: precise prefix routing on", endpoint)
                return fetched
            await sleep(wait_s)
            # No replica listed yet: look again soon; every listed one failed: less often each round.
            wait_s = min(MAX_INTERVAL_S, wait_s * 2) if listed else interval_s


def switch_to(current: str, served: Mapping[str, str | None]) -> str | None:
    """The digest to change to (pure): the one every replica that answered serves, when it is not `current`; None
    while they differ (a rollout or a canary under way: the current one still matches some engines) or agree with
    it."""
    digests = {found for found in served.values() if found is not None}
    if len(digests) != 1:
        return None
    (only,) = digests
    return only if only != current else None


async def follow_tokenizer(use: Callable[[PromptTokenizer], None], endpoints: Callable[[], Iterable[str]],
                           current: str, check_s: float = CHECK_S, sleep: Sleep = asyncio.sleep) -> None:
    """Every `check_s`, each replica's tokenizer digest; `use` the new tokenizer once they all serve another."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
        while True:
            await sleep(check_s)
            served = {endpoint: await _digest(session, endpoint) for endpoint in sorted(endpoints())}
            wanted = switch_to(current, served)
            if wanted is None:
                continue
            endpoint = next(e for e, found in served.items() if found == wanted)
            try:
                fetched = await read_tokenizer(session, endpoint)
            except Exception as exc:  # tried again at the next check
                log.warning("the replicas' new tokenizer could not be read from %s: %s", endpoint, exc)
                continue
            if fetched.digest == wanted:
                use(fetched.tokenizer)
                current = wanted
                log.info("the replicas serve another tokenizer (a new model): read from %s", endpoint)


async def _digest(session: aiohttp.ClientSession, endpoint: str) -> str | None:
    try:
        async with session.get(f"http://{endpoint}{TOKENIZER_PATH}") as answer:
            answer.raise_for_status()
            found = (await answer.json()).get("digest")
    except Exception:  # not answering now (starting, going away): not counted
        return None
    return found if isinstance(found, str) else None
