"""kube.apply re-checks a child's owner right before applying it: a pass that read its object just before the
object was deleted must not re-create a child the garbage collector has just removed (found by the operator-churn
chaos test). The check is a GET, or an answer of the API server for the owner at most one round trip old (the
pass's own status write). The API server is an in-memory fake behind the client's single HTTP entry point
(`_call`), and the runner ends such a pass quietly."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from loom.operator.core import client
from loom.operator.core import client as kube
from loom.operator.core.kit import taken_by
from loom.operator.core.runner import Runner
from loom.operator.core.watch_cache import WatchCache

pytestmark = pytest.mark.timeout(30)

OWNER_PATH = "/apis/loom.dev/v1alpha1/namespaces/ml/inferenceservices/bot"
OWNER: dict[str, Any] = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "bot", "namespace": "ml", "uid": "u1"},
}


def child(name: str, uid: str = "u1", controller: bool = True) -> dict[str, Any]:
    ref = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "name": "bot", "uid": uid,
           "controller": controller, "blockOwnerDeletion": True}  # fmt: skip
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ml", "ownerReferences": [ref]}, "data": {}}  # fmt: skip


class FakeServer:
    """Objects by path; records every (method, path) it was sent."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {OWNER_PATH: OWNER}
        self.calls: list[tuple[str, str]] = []
        self.options: list[dict[str, Any]] = []

    async def __call__(self, method: str, path: str, **options: Any) -> Any:
        self.calls.append((method, path))
        self.options.append(options)
        if method == "GET":
            await asyncio.sleep(0)  # in flight: other requests go out meanwhile
            if path not in self.objects:
                raise client.NotFound(path)
            return self.objects[path]
        if path.endswith("/status"):  # a status write answers with the whole object
            return self.objects[path.removesuffix("/status")]
        if method == "POST":  # a create: to the collection, the name in the body
            path = f"{path}/{options['body']['metadata']['name']}"
            if path in self.objects:
                raise client.Conflict(path)
        self.objects[path] = {"metadata": {"name": path.rsplit("/", 1)[-1]}}
        return self.objects[path]

    def patched(self) -> list[str]:
        return [path for method, path in self.calls if method == "PATCH"]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    monkeypatch.setattr(client, "_call", fake)
    monkeypatch.setattr(client, "WATCHED", WatchCache())
    return fake


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The client's monotonic clock, set by the test."""
    now = [1000.0]
    monkeypatch.setattr(client, "time", SimpleNamespace(monotonic=lambda: now[0]))  # the client's only use of time
    return now


async def test_a_child_is_applied_after_one_get_of_its_live_owner(server: FakeServer) -> None:
    await kube.apply(child("bot-config"))
    assert server.calls == [("GET", OWNER_PATH), ("PATCH", "/api/v1/namespaces/ml/configmaps/bot-config")]


async def test_a_deleted_owner_stops_the_apply(server: FakeServer) -> None:
    del server.objects[OWNER_PATH]
    with pytest.raises(kube.OwnerGone, match="InferenceService ml/bot uid u1"):
        await kube.apply(child("bot-config"))
    assert server.patched() == []


async def test_a_namesake_owner_with_another_uid_stops_the_apply(server: FakeServer) -> None:
    # Deleted and created again under the same name: the child rendered for the old one must not be applied.
    server.objects[OWNER_PATH] = {**OWNER, "metadata": {"name": "bot", "namespace": "ml", "uid": "u2"}}
    with pytest.raises(kube.OwnerGone):
        await kube.apply(child("bot-config", uid="u1"))
    assert server.patched() == []


async def test_objects_without_a_controlling_owner_are_applied_without_a_check(server: FakeServer) -> None:
    del server.objects[OWNER_PATH]
    shared = child("project-config", controller=False)  # a FeatureView project child: owned by several, none controls
    plain = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "free", "namespace": "ml"}}
    await kube.apply(shared)
    await kube.apply(plain)
    assert [method for method, _ in server.calls] == ["PATCH", "PATCH"]


async def test_every_apply_checks_its_owner_right_before_its_patch(server: FakeServer, clock: list[float]) -> None:
    await asyncio.gather(*(kube.apply(child(f"bot-{i}")) for i in range(4)))
    # Applies that start together each check: none can rely on an answer that has not come yet.
    methods = [method for method, _ in server.calls]
    assert methods.count("GET") == 4 and len(server.patched()) == 4
    clock[0] += 0.4  # an owner answer this recent is the check (one busy round trip old)
    await kube.apply(child("bot-0"))
    assert server.calls[-1] == ("PATCH", "/api/v1/namespaces/ml/configmaps/bot-0")
    clock[0] += 0.2  # older than ALIVE_S: asked again
    await kube.apply(child("bot-1"))
    assert server.calls[-2:] == [("GET", OWNER_PATH), ("PATCH", "/api/v1/namespaces/ml/configmaps/bot-1")]


async def test_the_pass_status_write_is_the_owner_check_of_the_children_after_it(
    server: FakeServer, clock: list[float]
) -> None:
    # A TrainingJob's pass writes its status first, then applies its children: the write's answer proves the owner.
    await kube.patch_status("loom.dev/v1alpha1", "InferenceService", "ml", "bot", {"phase": "Pending"})
    server.calls.clear()
    await asyncio.gather(kube.apply(child("bot-config")), kube.apply(child("bot-svc")))
    assert [method for method, _ in server.calls] == ["PATCH", "PATCH"]


async def test_the_status_write_names_loom_as_its_field_manager(server: FakeServer) -> None:
    await kube.patch_status("loom.dev/v1alpha1", "InferenceService", "ml", "bot", {"phase": "Pending"})
    assert server.calls == [("PATCH", OWNER_PATH + "/status")]
    assert ("fieldManager", "loom-operator") in server.options[0]["query"]


async def test_a_created_child_is_posted_after_its_owner_check_and_an_existing_one_is_left_alone(
    server: FakeServer, clock: list[float]
) -> None:
    pod = {**child("bot-worker-0"), "kind": "Pod"}
    created = await kube.create(pod)
    assert created == {"metadata": {"name": "bot-worker-0"}}
    assert server.calls == [("GET", OWNER_PATH), ("POST", "/api/v1/namespaces/ml/pods")]
    assert ("fieldManager", "loom-operator") in server.options[-1]["query"]
    assert server.options[-1]["body"] is pod
    # Created before (a worker of the previous attempt still terminating, say): left as it is, no error.
    server.calls.clear()
    assert await kube.create(pod) is None
    assert [method for method, _ in server.calls] == ["POST"]  # the first GET's answer is still the owner check


async def test_a_deleted_owner_stops_a_create(server: FakeServer) -> None:
    del server.objects[OWNER_PATH]
    with pytest.raises(kube.OwnerGone):
        await kube.create({**child("bot-worker-0"), "kind": "Pod"})
    assert [method for method, _ in server.calls] == ["GET"]


async def test_a_deleted_event_or_a_deletion_ends_the_proof_at_once(server: FakeServer, clock: list[float]) -> None:
    await kube.apply(child("bot-config"))  # the GET's answer proves the owner for ALIVE_S
    client.WATCHED.seen("DELETED", OWNER)
    del server.objects[OWNER_PATH]
    with pytest.raises(kube.OwnerGone):
        await kube.apply(child("bot-deployment"))
    # Being deleted (a finalizer or foreground deletion holds it): no longer an owner to apply children for.
    deleting = {**OWNER, "metadata": {**OWNER["metadata"], "deletionTimestamp": "2026-11-27T12:00:00Z"}}
    server.objects[OWNER_PATH] = deleting
    with pytest.raises(kube.OwnerGone):
        await kube.apply(child("bot-deployment"))
    server.objects[OWNER_PATH] = OWNER
    await kube.apply(child("bot-deployment"))  # a live answer again
    client.WATCHED.seen("MODIFIED", deleting)  # the watch brings the deletion: the proof ends
    server.objects[OWNER_PATH] = deleting
    with pytest.raises(kube.OwnerGone):
        await kube.apply(child("bot-deployment"))


async def test_a_proof_is_for_one_uid(server: FakeServer, clock: list[float]) -> None:
    await kube.apply(child("bot-config"))
    server.objects[OWNER_PATH] = {
        **OWNER,
        "metadata": {"name": "bot", "namespace": "ml", "uid": "u2"},
    }  # a namesake, at once
    with pytest.raises(kube.OwnerGone):
        await kube.apply(child("bot-svc", uid="u2-stale"))
    await kube.apply(child("bot-svc", uid="u2"))


async def test_a_pass_whose_object_is_deleted_midway_ends_quietly(
    server: FakeServer, clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    async def one_pass(namespace: str, name: str) -> None:
        await kube.apply(child("bot-config"))
        del server.objects[OWNER_PATH]  # the object is deleted while its pass runs,
        clock[0] += 1.0  # which takes longer than a round trip to reach its next apply
        await kube.apply(child("bot-deployment"))
        raise AssertionError("the pass went on after its owner was deleted")

    runner = Runner("InferenceService", one_pass, interval_s=3600, timeout_s=30)
    with caplog.at_level(logging.DEBUG, logger="loom.operator.runner"):
        await runner.trigger("ml", "bot")
    assert server.patched() == ["/api/v1/namespaces/ml/configmaps/bot-config"]  # the second child never created
    runner_lines = [r for r in caplog.records if r.name == "loom.operator.runner"]
    assert [r.levelno for r in runner_lines] == [logging.INFO]
    assert "deleted during its pass" in runner_lines[0].getMessage()


async def test_no_deletion_gets_between_the_owner_check_and_the_apply(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found at report scale (churn, 100 objects, load 15): with the sync client's worker threads all busy, an apply
    that had checked its owner queued for a thread again before its PATCH, long enough for the owner's deletion and
    the garbage collector to come in between. Here: a deletion made ready the moment the owner check answers; the
    apply's PATCH goes out before it runs."""
    loop = asyncio.get_running_loop()

    def delete_owner_and_children() -> None:
        server.objects.pop(OWNER_PATH, None)
        server.objects.pop("/api/v1/namespaces/ml/configmaps/bot-config", None)  # the garbage collector
        server.calls.append(("DELETE", OWNER_PATH))

    async def call(method: str, path: str, **kw: Any) -> Any:
        answer = await server(method, path, **kw)
        if method == "GET":
            loop.call_soon(delete_owner_and_children)  # runs as soon as the apply lets the loop turn
        return answer

    monkeypatch.setattr(client, "_call", call)
    await kube.apply(child("bot-config"))
    await asyncio.sleep(0)
    # The child was applied before the deletion (and collected with its owner), never after it.
    assert server.calls[-1] == ("DELETE", OWNER_PATH), server.calls
    assert "/api/v1/namespaces/ml/configmaps/bot-config" not in server.objects


async def test_children_written_beside_their_owners_status_write_send_no_get(
    server: FakeServer, clock: list[float]
) -> None:
    # A TrainingJob's first children go out with its status write (reconcile.py `prepare`): that write's answer is
    # their owner check, so none of them waits for a GET first.
    await asyncio.gather(
        kube.patch_status("loom.dev/v1alpha1", "InferenceService", "ml", "bot", {"phase": "Pending"}),
        kube.apply(child("bot-config"), owner_written_beside=True),
        kube.apply(child("bot-svc"), owner_written_beside=True),
    )
    assert [method for method, _ in server.calls] == ["PATCH", "PATCH", "PATCH"]


def namesake_child(name: str, owner_name: str, uid: str) -> dict[str, Any]:
    """A Loom child (in the watch cache) controlled by another object, e.g. the service `bot-decode`'s ConfigMap."""
    ref = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "name": owner_name, "uid": uid,
           "controller": True}  # fmt: skip
    return {"apiVersion": "v1", "kind": "ConfigMap", "data": {"theirs": "1"},
            "metadata": {"name": name, "namespace": "ml", "resourceVersion": "7", "ownerReferences": [ref],
                         "labels": {"app.kubernetes.io/managed-by": "loom"}}}  # fmt: skip


async def test_a_child_name_that_is_another_objects_child_is_not_taken_over(
    server: FakeServer, clock: list[float], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name Loom derives for a child (`<name>-decode`, `<name>-canary`) may be another object's own child: the
    apply, under Loom's one field manager, would take it over (spec and owner). It is refused; the pass ends with
    the object's Ready condition saying whose it is (reason NameTaken), no traceback, nothing written."""
    client.WATCHED.seen("ADDED", namesake_child("bot-decode", "bot-decode", "u9"))
    mine = child("bot-decode")
    with pytest.raises(kube.NameTaken, match="ConfigMap bot-decode belongs to InferenceService bot-decode"):
        await kube.apply(mine)
    assert server.patched() == []

    async def one_pass(namespace: str, name: str) -> None:
        await kube.apply(mine)

    runner = Runner("InferenceService", one_pass, interval_s=3600, timeout_s=30)
    with caplog.at_level(logging.DEBUG, logger="loom.operator.runner"):
        await runner.trigger("ml", "bot")
    assert server.patched() == [OWNER_PATH + "/status"]  # the status write only, no child
    ready = next(c for c in server.options[-1]["body"]["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameTaken")
    assert "belongs to InferenceService bot-decode" in ready["message"]
    assert [r.levelno for r in caplog.records if r.name == "loom.operator.runner"] == [logging.WARNING]

    # A predecessor of the same name (deleted and made again: the garbage collector is on its way) is no conflict.
    client.WATCHED.seen("MODIFIED", namesake_child("bot-decode", "bot", "u0-old"))
    await kube.apply(mine)
    assert server.patched()[-1] == "/api/v1/namespaces/ml/configmaps/bot-decode"


def test_taken_by_names_only_another_objects_controller() -> None:
    mine = child("bot-x")
    assert taken_by(None, mine) is None
    assert taken_by(child("bot-x"), mine) is None  # ours
    assert taken_by(child("bot-x", controller=False), mine) is None  # nobody controls it
    theirs = namesake_child("bot-x", "other", "u9")
    assert taken_by(theirs, mine) == theirs["metadata"]["ownerReferences"][0]
    shared = child("project-config", controller=False)  # a FeatureView project child controls nothing
    assert taken_by(theirs, shared) is None
