"""Closes a gap in Kopf's namespace observation for an operator that watches namespace patterns (`<prefix>-*`).

Kopf lists the namespaces once, then starts a watch that makes its own initial listing and ignores every object
in it (`raw_event['type'] is None`), trusting the first listing to have seen them. A namespace created between the
two listings is in neither's events: it arrives only in the ignored second listing, so Kopf never watches it and
the Loom objects in it are never reconciled until the operator restarts (seen in CI: an InferenceService applied
right after start kept `status: null` for 90 s while one in a later namespace was served). Treating the second
listing's objects like the first listing's closes it: adding a namespace already known is a no-op.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

ProcessNamespaceEvent = Callable[..., Awaitable[None]]


def notice_namespaces_listed_by_the_watch() -> ProcessNamespaceEvent:
    """Replace Kopf's namespace event processor (looked up by name when its observer starts its watch) with one
    that also revises the namespaces on the watch's initial listing. Idempotent; returns the processor in use."""
    from kopf._core.reactor import observation

    original: ProcessNamespaceEvent = observation.process_discovered_namespace_event
    if getattr(original, "__loom_lists_namespaces__", False):
        return original

    @functools.wraps(original)
    async def process(*, raw_event: Any, namespaces: Any, insights: Any, **rest: Any) -> None:
        if raw_event["type"] is None:
            async with insights.revised:
                observation.revise_namespaces(raw_events=[raw_event], insights=insights, namespaces=namespaces)
                insights.revised.notify_all()
            return
        await original(raw_event=raw_event, namespaces=namespaces, insights=insights, **rest)

    process.__loom_lists_namespaces__ = True  # type: ignore[attr-defined]
    observation.process_discovered_namespace_event = process
    return process
