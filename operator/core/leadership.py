"""Which replica reconciles, for the operator's loops that run outside Kopf's handlers.

With peering on (`OperatorSettings.peering_name`), Kopf elects the active replica through a ClusterKopfPeering:
every replica writes a keep-alive (priority, lifetime, last seen) into its status; a replica that sees a live
peer of higher or equal priority pauses its watches and handlers, and resumes when that peer's keep-alive
expires (a clean exit removes it at once). Kopf pauses only what it runs, though: the runner's periodic resync
and the builtin autoscaler are plain asyncio tasks that would go on reconciling in a paused replica. They ask
`LEADERSHIP.leads()` before every round, which reads the same peering object and applies Kopf's rule
(`leads`, pure), so they stop and resume with Kopf's handlers (within one round).

The priority is chosen so that the oldest replica leads: minus its start time in milliseconds. A replacement pod
(newer, lower) waits instead of preempting the replica that works, so a takeover happens only when the active
replica dies or exits. Kopf's own tools still work: `kopf freeze` (priority 100) pauses every Loom replica.

What peering does not give (documented in charts/loom/README.md): fencing. A replica that stalls longer than the
lifetime without dying is presumed dead; its peer takes over, and the stalled one, older, resumes and pauses its
peer again once it writes a keep-alive; passes already running finish (bounded by reconcile_timeout_s).
"""

from __future__ import annotations

import asyncio
import datetime
import getpass
import logging
import os
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..settings import OperatorSettings
from . import client as kube
from .observability import LEADER

log = logging.getLogger("loom.operator.leadership")

PEERING_API_VERSION = "kopf.dev/v1"
PEERING_KIND = "ClusterKopfPeering"
# Kopf's defaults for a peer entry that lacks a field.
_DEFAULT_LIFETIME_S = 60


@dataclass(frozen=True)
class Peer:
    identity: str
    priority: int
    deadline: datetime.datetime

    def alive(self, now: datetime.datetime) -> bool:
        return self.deadline > now


def peers(status: Mapping[str, Any] | None) -> list[Peer]:
    """The peers a ClusterKopfPeering's status lists (Kopf writes {identity: {priority, lifetime, lastseen}})."""
    found = []
    for identity, info in (status or {}).items():
        if not isinstance(info, Mapping):
            continue
        lastseen = info.get("lastseen")
        seen = (
            datetime.datetime.fromisoformat(str(lastseen))
            if lastseen is not None
            else datetime.datetime.now(datetime.UTC)
        )
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        lifetime = datetime.timedelta(seconds=int(info.get("lifetime", _DEFAULT_LIFETIME_S)))
        found.append(Peer(str(identity), int(info.get("priority", 0)), seen + lifetime))
    return found


def leads(status: Mapping[str, Any] | None, identity: str, priority: int, now: datetime.datetime) -> bool:
    """Kopf's rule (kopf._core.engines.peering.process_peering_event): a replica works unless another live peer
    has a higher priority (it pauses in favour of it) or the same one (both pause: a conflict)."""
    return not any(p.identity != identity and p.alive(now) and p.priority >= priority for p in peers(status))


def identity_of(settings: OperatorSettings) -> str:
    """This replica's name among its peers: the pod's name in a cluster, else who runs it where and since when
    (Kopf's own form)."""
    if settings.pod_name:
        return settings.pod_name
    started = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    suffix = "".join(random.choices("abcdefhijklmnopqrstuvwxyz0123456789", k=3))
    return f"{user_name()}@{socket.gethostname()}/{started}/{suffix}"


def user_name() -> str:
    """Who runs this process: the login name, else the uid. A pod may run under a uid its image has no passwd entry
    for (the chart's 65532, OpenShift's assigned ranges), where getpass.getuser() raises."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def priority_of(settings: OperatorSettings, started_s: float | None = None) -> int:
    """The configured priority, or minus the start time in ms: the oldest replica has the highest."""
    if settings.peering_priority is not None:
        return settings.peering_priority
    return -int((time.time() if started_s is None else started_s) * 1000)


class Leadership:
    """Whether this replica should run its own loops now. Standalone (the default): always."""

    def __init__(self) -> None:
        self.peering_name: str | None = None
        self.identity = ""
        self.priority = 0
        self._cached: tuple[float, bool] | None = None
        self._cache_s = 1.0
        self._lock = asyncio.Lock()

    def configure(self, peering_name: str | None, identity: str, priority: int, *, lifetime_s: int = 30) -> None:
        self.peering_name, self.identity, self.priority = peering_name, identity, priority
        # Rounds of several loops ask at once: one read serves them, fresh well within a lifetime.
        self._cache_s = min(2.0, lifetime_s / 10)
        self._cached = None
        LEADER.set(1 if peering_name is None else 0)  # a peer stands by until it reads that it leads

    async def leads(self) -> bool:
        if self.peering_name is None:
            return True
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self._cache_s:
                return self._cached[1]
            previous = None if self._cached is None else self._cached[1]
            try:
                body = await kube.get(PEERING_API_VERSION, PEERING_KIND, None, self.peering_name)
            except Exception as error:  # the API server unreachable: a replica that cannot tell must not act
                log.warning("reading peering %s failed (%s); this replica's own loops pause", self.peering_name, error)
                result = False
            else:
                if body is None:
                    log.warning("peering object %s %s is missing; this replica's own loops pause", PEERING_KIND,
                                self.peering_name)  # fmt: skip
                    result = False
                else:
                    now_utc = datetime.datetime.now(datetime.UTC)
                    result = leads(body.get("status"), self.identity, self.priority, now_utc)
            LEADER.set(1 if result else 0)
            if result != previous:
                log.info("replica %s %s", self.identity, "leads: its loops run" if result else "stands by")
            self._cached = (now, result)
            return result


# The one per process: main configures it, the runner's resync and the autoscaler ask it.
LEADERSHIP = Leadership()
