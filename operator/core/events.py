"""Posting the events a pure state machine returned (Kopf queues them and writes them as Kubernetes Events)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import kopf

from .kit import Event, Manifest


def post_events(body: Manifest, events: Iterable[Event]) -> None:
    for event in events:
        # Kopf reads only apiVersion/kind/metadata from the body, which a raw object has.
        kopf.event(cast(kopf.Body, body), type=event.type, reason=event.reason, message=event.message)
