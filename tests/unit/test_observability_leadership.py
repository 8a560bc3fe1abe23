"""High availability: which replica reconciles. The pure rule agrees with Kopf's own peering decision on the
status Kopf itself writes; the runner's resync and the autoscaler skip their rounds while a replica stands by;
Kopf gets the peering settings."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import kopf
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._core.engines import peering as kopf_peering
from prometheus_client import REGISTRY

from loom.devstack.images import IMAGE_ENV, IMAGE_SETTINGS
from loom.operator.core import leadership
from loom.operator.core.leadership import Leadership, leads, priority_of
from loom.operator.core.runner import Runner
from loom.operator.main import configure
from loom.operator.settings import OperatorSettings

pytestmark = pytest.mark.timeout(30)

NOW = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)


def entry(priority: int, *, seen_ago_s: float, lifetime_s: int = 30) -> dict[str, Any]:
    """A peer's entry as Kopf writes it (its own Peer.as_dict)."""
    seen = (NOW - datetime.timedelta(seconds=seen_ago_s)).isoformat()
    peer = kopf_peering.Peer(identity=kopf_peering.Identity("x"), priority=priority, lifetime=lifetime_s, lastseen=seen)
    return peer.as_dict()


# Priorities read "minus the start time": -100 started before -200, so it is the older and wins.
CASES = {
    "alone": ({"me": entry(-100, seen_ago_s=1)}, True),
    "a newer live peer": ({"me": entry(-100, seen_ago_s=1), "new": entry(-200, seen_ago_s=5)}, True),
    "an older live peer": ({"me": entry(-200, seen_ago_s=1), "old": entry(-100, seen_ago_s=5)}, False),
    "an older peer, dead": ({"me": entry(-200, seen_ago_s=1), "old": entry(-100, seen_ago_s=31)}, True),
    "an older one left": ({"me": entry(-200, seen_ago_s=1), "old": entry(-100, seen_ago_s=0, lifetime_s=0)}, True),
    "the same priority": ({"me": entry(-100, seen_ago_s=1), "twin": entry(-100, seen_ago_s=1)}, False),
    "not listed yet": ({"other": entry(-300, seen_ago_s=1)}, True),
}


@pytest.mark.parametrize("case", CASES)
def test_the_rule_is_kopfs(case: str) -> None:
    status, expected = CASES[case]
    mine = status["me"]["priority"] if "me" in status else -100
    assert leads(status, "me", mine, NOW) is expected


@pytest.mark.parametrize("case", CASES)
async def test_kopf_pauses_exactly_when_the_rule_says_stand_by(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kopf's own process_peering_event, fed the same object at the same instant, pauses this replica exactly
    when `leads` is False."""
    status, _ = CASES[case]
    mine = status["me"]["priority"] if "me" in status else -100
    settings = kopf.OperatorSettings()
    settings.peering.name, settings.peering.priority = "loom", mine
    monkeypatch.setattr(kopf_peering.datetime, "datetime", _FrozenDatetime)
    toggles = aiotoggles.ToggleSet(any)
    paused = await toggles.make_toggle(True)  # mandatory peering starts paused
    pressure = asyncio.Event()
    pressure.set()  # no sleeping until a blocking peer expires
    event: Any = {"type": "MODIFIED", "object": {"metadata": {"name": "loom"}, "status": status}}
    await kopf_peering.process_peering_event(
        raw_event=event,
        namespace=None,
        resource=kopf.Resource("kopf.dev", "v1", "clusterkopfpeerings"),
        identity=kopf_peering.Identity("me"),
        settings=settings,
        autoclean=False,
        stream_pressure=pressure,
        conflicts_found=paused,
    )
    assert paused.is_off() is leads(status, "me", mine, NOW)


class _FrozenDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> _FrozenDatetime:  # type: ignore[override]
        return cls.fromtimestamp(NOW.timestamp(), tz)


def test_the_oldest_replica_has_the_highest_priority_unless_one_is_set() -> None:
    older, newer = (
        priority_of(OperatorSettings(**IMAGE_SETTINGS), 1000.0),
        priority_of(OperatorSettings(**IMAGE_SETTINGS), 1000.5),
    )
    assert older > newer and older == -1_000_000
    assert priority_of(OperatorSettings(**IMAGE_SETTINGS, peering_priority=7), 1000.0) == 7
    assert (
        leadership.identity_of(OperatorSettings(**IMAGE_SETTINGS, pod_name="loom-operator-abc")) == "loom-operator-abc"
    )
    assert "@" in leadership.identity_of(OperatorSettings(**IMAGE_SETTINGS))


def test_a_uid_without_a_passwd_entry_still_names_the_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart runs the operator as uid 65532, which the image's /etc/passwd does not list: getpass.getuser()
    raises there (found on the real node: the operator crash-looped before its first pass)."""
    for variable in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(variable, raising=False)

    def no_entry(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr("pwd.getpwuid", no_entry)
    monkeypatch.setattr("os.getuid", lambda: 65532)
    identity = leadership.identity_of(OperatorSettings(**IMAGE_SETTINGS))
    assert identity.startswith("65532@"), identity


async def test_leadership_reads_the_peering_object(monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[Any] = []

    async def get(api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        assert (api_version, kind, namespace, name) == ("kopf.dev/v1", "ClusterKopfPeering", None, "loom-operator")
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(leadership.kube, "get", get)
    now = datetime.datetime.now(datetime.UTC)
    fresh = now.isoformat()
    gate = Leadership()
    assert await gate.leads()  # standalone: always
    gate.configure("loom-operator", "pod-b", -200, lifetime_s=5)
    gate._cache_s = 0  # every call reads
    assert REGISTRY.get_sample_value("loom_leader") == 0
    answers[:] = [
        {"status": {"pod-a": {"priority": -100, "lifetime": 30, "lastseen": fresh}}},  # an older pod-a is alive
        {"status": {"pod-a": {"priority": -300, "lifetime": 30, "lastseen": fresh}}},  # a newer one
        None,  # the object is gone (uninstalled)
        OSError("connection refused"),
    ]
    assert await gate.leads() is False  # -100 > -200: the older pod-a has the higher priority
    assert await gate.leads() is True and REGISTRY.get_sample_value("loom_leader") == 1
    assert await gate.leads() is False  # no object: nobody can tell who leads
    assert await gate.leads() is False and REGISTRY.get_sample_value("loom_leader") == 0


async def test_a_standing_by_replica_runs_no_resync_round(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    leading = asyncio.Event()

    async def reconcile(namespace: str, name: str) -> None:
        calls.append(name)

    async def leads() -> bool:
        return leading.is_set()

    monkeypatch.setattr(leadership.LEADERSHIP, "leads", leads)
    runner = Runner("Standby", reconcile, interval_s=0.01, timeout_s=5)
    runner.resync({("ns", "a"): [True]})
    try:
        await asyncio.sleep(0.2)  # some twenty rounds skipped
        assert calls == []
        leading.set()  # the peer died: this replica leads now
        while not calls:
            await asyncio.sleep(0.01)
    finally:
        await runner.stop()
    assert set(calls) == {"a"}


async def test_a_standing_by_replica_autoscales_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.operator.autoscale.loop import Autoscaler
    from loom.operator.kinds.inferenceservice.autoscaling.io import ADAPTER as ISVC_ADAPTER

    rounds: list[list[tuple[str, str]]] = []
    leading = False

    async def leads() -> bool:
        return leading

    monkeypatch.setattr(leadership.LEADERSHIP, "leads", leads)
    autoscaler = Autoscaler(OperatorSettings(**IMAGE_SETTINGS, autoscale_interval_s=0.01), adapter=ISVC_ADAPTER)

    async def round(due: list[tuple[str, str]]) -> None:
        rounds.append(due)

    monkeypatch.setattr(autoscaler, "round", round)
    autoscaler.start({("ns", "isvc"): [True]})
    try:
        await asyncio.sleep(0.2)
        assert rounds == []
        leading = True
        while not rounds:
            await asyncio.sleep(0.01)
    finally:
        await autoscaler.stop()
    assert rounds[0] == [("ns", "isvc")]


def test_kopf_gets_cluster_wide_peering_with_the_lifetime() -> None:
    settings = kopf.OperatorSettings()
    configure(
        settings,
        OperatorSettings(**IMAGE_SETTINGS, peering_name="loom-operator", peering_lifetime_s=15, namespaces=["a"]),
    )
    assert settings.peering.clusterwide is True  # one object per release, even for a namespaced operator
    assert (settings.peering.lifetime, settings.peering.stealth) == (15, True)
    with pytest.raises(ValueError, match="LOOM_PEERING_NAME"):
        OperatorSettings.from_env({**IMAGE_ENV, "LOOM_PEERING_NAME": "Not A Name"})
