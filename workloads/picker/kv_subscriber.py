"""The picker's subscriptions to its replicas' KV-cache events (ZMQ SUB, one socket per replica): what each
publishes goes to precise.PrecisePrefix; replicas that come and go are followed every `interval_s`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping

import zmq
import zmq.asyncio

from .config import PickerConfig
from .precise import PrecisePrefix
from .state import PickerState

log = logging.getLogger("loom.workloads.picker")


async def follow(precise: PrecisePrefix, endpoints: Callable[[], Iterable[str]], address_of: Callable[[str], str],
                 topic: str, interval_s: float) -> None:
    context = zmq.asyncio.Context()
    tasks: dict[str, asyncio.Task[None]] = {}
    try:
        while True:
            current = set(endpoints())
            for endpoint in current - set(tasks):
                tasks[endpoint] = asyncio.create_task(_subscribe(context, precise, endpoint, address_of(endpoint),
                                                                 topic))
            for gone in set(tasks) - current:
                tasks.pop(gone).cancel()
            precise.keep(sorted(current))
            await asyncio.sleep(interval_s)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        context.term()


async def _subscribe(context: zmq.asyncio.Context, precise: PrecisePrefix, endpoint: str, address: str,
                     topic: str) -> None:
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    socket.connect(address)
    log.info("following KV events of %s at %s", endpoint, address)
    try:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue  # not vLLM's (topic, sequence, payload)
            try:
                precise.apply(endpoint, frames[1], frames[2])
            except ValueError as exc:
                log.warning("unreadable KV event batch from %s: %s", endpoint, exc)
    finally:
        socket.close(linger=0)


def address_for(port: int) -> Callable[[str], str]:
    """A replica's publisher: its pod's address, the events' port."""

    def address(endpoint: str) -> str:
        return f"tcp://{endpoint.rsplit(':', 1)[0]}:{port}"

    return address


def start_following(config: PickerConfig, state: PickerState,
                    addresses: Mapping[str, str] | None = None) -> asyncio.Task[None] | None:
    """Precise prefix routing when the config asks for it: the state scores by the engines' events, followed from
    each replica's address (`addresses`: fixed ones by endpoint, else the pod's address and the events' port). The
    tokenizer comes from the config's folder, else from a replica's front (tokenizer_fetch.py); until it is read,
    state.precise stays None and every request is routed by the estimate."""
    if config.kv_events is None or config.policy != "prefix-cache":
        return None
    events = config.kv_events
    fixed = dict(addresses or {})
    by_pod = address_for(events.port)

    async def run() -> None:
        from .precise import PreciseMetrics
        from .prompt_tokens import PromptTokenizer
        from .tokenizer_fetch import follow_tokenizer, tokenizer_from_replicas

        fetched = None
        if events.tokenizer_dir is not None:
            tokenizer = PromptTokenizer.from_folder(events.tokenizer_dir)
        else:
            fetched = await tokenizer_from_replicas(lambda: list(state.pods), config.poll_interval_s)
            tokenizer = fetched.tokenizer
        precise = PrecisePrefix(tokenizer, PreciseMetrics(state.metrics.service, state.metrics.registry),
                                silence_s=events.silence_seconds, relearn_s=events.relearn_seconds)
        state.precise = precise

        def use(new: PromptTokenizer) -> None:
            precise.tokenizer = new

        following = [follow(precise, lambda: list(state.pods), lambda e: fixed.get(e) or by_pod(e), events.topic,
                            config.poll_interval_s)]
        if fetched is not None:  # read from the replicas: a new model's tokenizer is followed too
            following.append(follow_tokenizer(use, lambda: list(state.pods), fetched.digest))
        await asyncio.gather(*following)

    return asyncio.create_task(run())
