"""The watch cache: in a steady state a pass neither re-reads its object or its children nor re-applies a child
nobody changed; any change, deletion or lapse of the watch sends it to the API server again, and after a write of
its own a pass never reads a status older than that write (operator/core/watch_cache.py)."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.core import client as kube
from loom.operator.core.kit import MANAGED_BY
from loom.operator.core.watch_cache import AWAIT_S, MAX_AGE_S, WatchCache, key_of

OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "name": "bot", "uid": "u-1",
         "controller": True}


def deployment(version: str | None = None, replicas: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "bot", "namespace": "ml", "ownerReferences": [OWNER],
                            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}}
    if version is not None:
        meta["resourceVersion"] = version
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {"replicas": replicas}}


def job(version: str, attempt: int) -> dict[str, Any]:
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "gpt", "namespace": "ml", "resourceVersion": version}, "status": {"attempt": attempt}}


def test_an_applied_child_nobody_wrote_since_is_unchanged() -> None:
    cache = WatchCache()
    key = key_of(deployment())
    cache.applied(deployment("7"), "d1", now=0.0)
    assert cache.unchanged(key, "d1", now=1.0) == deployment("7")
    cache.seen("MODIFIED", deployment("7"))  # the watch delivers Loom's own write
    assert cache.unchanged(key, "d1", now=3.0) == deployment("7")


def test_another_manifest_a_later_write_a_deletion_or_age_each_mean_apply_again() -> None:
    cache = WatchCache()
    key = key_of(deployment())
    cache.applied(deployment("7"), "d1", now=0.0)
    assert cache.unchanged(key, "d2", now=1.0) is None  # Loom renders something else now
    assert cache.unchanged(key, "d1", now=MAX_AGE_S + 1) is None  # a periodic re-apply all the same
    cache.seen("MODIFIED", deployment("8", replicas=3))  # someone (or a status update) wrote it
    assert cache.unchanged(key, "d1", now=3.0) is None
    assert cache.body(key, now=3.0) == deployment("8", replicas=3)
    cache.applied(deployment("9"), "d1", now=4.0)
    cache.seen("DELETED", deployment("9"))
    assert cache.unchanged(key, "d1", now=6.0) is None and cache.body(key, now=6.0) is None


def test_bodies_are_copies() -> None:
    cache = WatchCache()
    key = key_of(deployment())
    assert cache.body(key, now=0.0) is None
    cache.seen(None, deployment("3"))  # the watch's initial listing
    got = cache.body(key, now=1.0)
    assert got == deployment("3")
    got["spec"]["replicas"] = 99  # a caller's edit never reaches the cache
    assert cache.body(key, now=1.0) == deployment("3")


def test_after_its_own_status_write_a_pass_reads_afresh_until_the_watch_brings_that_write() -> None:
    cache = WatchCache()
    key = key_of(job("5", 1))
    cache.seen("MODIFIED", job("5", attempt=1))
    assert cache.body(key, now=0.0) == job("5", 1)
    cache.wrote(key, "6", now=0.0)  # status attempt 2 written; the API server answered resourceVersion 6
    assert cache.body(key, now=1.0) is None  # the cache still holds attempt 1: not served
    cache.seen("MODIFIED", job("5", attempt=1))  # a late event of the older state changes nothing
    assert cache.body(key, now=2.0) is None
    cache.seen("MODIFIED", job("6", attempt=2))
    assert cache.body(key, now=3.0) == job("6", 2)
    cache.wrote(key, "7", now=10.0)  # a write the watch never brings back (it re-listed at a later version)
    assert cache.body(key, now=10.0 + AWAIT_S / 2) is None
    assert cache.body(key, now=11.0 + AWAIT_S) == job("6", 2)


def test_after_its_own_status_write_a_pass_reads_the_object_as_that_write_answered() -> None:
    """A status write answers with the whole object: until the watch brings that write, that answer is served
    (nothing the watch holds is newer), never the older body; a scale's answer is not the object: read afresh."""
    cache = WatchCache()
    key = key_of(job("5", 1))
    cache.seen("MODIFIED", job("5", attempt=1))
    cache.wrote(key, "6", now=0.0, answer=job("6", attempt=2))
    assert cache.body(key, now=1.0) == job("6", 2)
    cache.seen("MODIFIED", job("5", attempt=1))  # a late event of the older state changes nothing
    got = cache.body(key, now=2.0)
    assert got == job("6", 2)
    got["status"]["attempt"] = 99  # a caller's edit never reaches the cache
    assert cache.body(key, now=2.0) == job("6", 2)
    cache.seen("MODIFIED", job("6", attempt=2))
    cache.seen("MODIFIED", job("7", attempt=3))  # someone else's later write, after the watch brought ours
    assert cache.body(key, now=3.0) == job("7", 3)
    scale = {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": "j", "resourceVersion": "8"}}
    cache.wrote(key, "8", now=4.0, answer=scale)
    assert cache.body(key, now=5.0) is None
    cache.wrote(key, "9", now=6.0, answer=job("9", attempt=4))
    assert cache.body(key, now=6.0 + AWAIT_S / 2) == job("9", 4)
    assert cache.body(key, now=7.0 + AWAIT_S) == job("7", 3)  # the watch never brought it: its last body again


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The kube layer against a fake API server that records each request and keeps one Deployment."""
    requests: list[tuple[str, str]] = []
    state = {"version": 10}
    monkeypatch.setattr(kube, "WATCHED", WatchCache())

    async def call(method: str, path: str, **_: Any) -> dict[str, Any] | None:
        requests.append((method, path))
        if method == "PATCH":
            state["version"] += 1
        if path.startswith("/apis/loom.dev"):
            return {"metadata": {"name": "bot", "uid": "u-1", "resourceVersion": str(state["version"])}}
        return deployment(str(state["version"]))

    monkeypatch.setattr(kube, "_call", call)
    return requests


async def test_a_steady_pass_sends_nothing_and_a_change_sends_the_apply_again(api: list[tuple[str, str]]) -> None:
    applied = await kube.apply(deployment())
    assert [m for m, _ in api] == ["GET", "PATCH"]  # the owner check, then the apply
    kube.WATCHED.seen("MODIFIED", applied)  # the watch delivers Loom's own write

    api.clear()
    assert await kube.apply(deployment()) == applied
    assert await kube.get("apps/v1", "Deployment", "ml", "bot") == applied
    assert api == []  # neither the apply nor the read went out

    await kube.apply(deployment(replicas=2))  # a different manifest
    assert [m for m, _ in api] == ["GET", "PATCH"]

    api.clear()
    kube.WATCHED.seen("DELETED", applied)
    assert await kube.get("apps/v1", "Deployment", "ml", "bot") is not None
    assert [m for m, _ in api] == ["GET"]  # gone from the cache: read from the API server


async def test_own_objects_are_read_from_the_cache_except_right_after_a_status_write(
    api: list[tuple[str, str]],
) -> None:
    watched = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "bot", "namespace": "ml", "resourceVersion": "10"}}
    kube.WATCHED.seen(None, watched)
    assert await kube.get("loom.dev/v1alpha1", "InferenceService", "ml", "bot") == watched
    assert api == []
    await kube.patch_status("loom.dev/v1alpha1", "InferenceService", "ml", "bot", {"phase": "Ready"})
    await kube.get("loom.dev/v1alpha1", "InferenceService", "ml", "bot")
    assert [m for m, _ in api] == ["PATCH", "GET"]


async def test_kinds_outside_the_cache_always_go_to_the_api_server(api: list[tuple[str, str]]) -> None:
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "bot", "namespace": "ml", "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}}}
    await kube.apply(account)
    await kube.apply(account)
    assert [m for m, _ in api] == ["PATCH", "PATCH"]


def test_a_get_that_found_nothing_holds_until_the_watch_brings_the_object() -> None:
    cache = WatchCache()
    key = key_of(deployment())
    cache.absent(key, now=0.0)
    assert cache.is_absent(key, now=1.0)
    cache.seen("ADDED", deployment("4"))
    assert not cache.is_absent(key, now=2.0) and cache.body(key, now=2.0) == deployment("4")
    cache.seen("DELETED", deployment("4"))
    assert not cache.is_absent(key, now=3.0)  # gone, but not known gone: the next GET says
    cache.absent(key, now=3.0)
    assert not cache.is_absent(key, now=4.0 + MAX_AGE_S)  # and it is asked again now and then


async def test_a_missing_canary_is_asked_for_once(api: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    async def not_found(method: str, path: str, **_: Any) -> None:
        api.append((method, path))
        raise kube.NotFound(path)

    monkeypatch.setattr(kube, "_call", not_found)
    for _ in range(3):
        assert await kube.get("apps/v1", "Deployment", "ml", "bot-canary") is None
        assert await kube.get("v1", "Service", "ml", "bot") is None
    assert [path.rsplit("/", 2)[-2] for _, path in api] == ["deployments", "services", "services", "services"]
